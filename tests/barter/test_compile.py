"""torch.compile of a wrapped model (`barter.compiling.compile_model`): it trains through every transfer with the
events of eager training, one compile per topology at most, and no graph break from score collection.

dynamo's guards and recompiles do not depend on the backend, so the tests compile with the "eager" backend
(no code generation): the CPU cost is dynamo's tracing alone.
"""
import pytest
import timm
import torch
from torch._dynamo.utils import counters

import barter
from barter.compiling import compile_model

STEPS = 16


def train(compiled: bool) -> tuple[barter.Controller, set, torch.nn.Module]:
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2, embed_dim=64,
                              num_heads=4, num_classes=10)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ctl = barter.wrap(model, optimizer, total_steps=STEPS, density=0.5, window=(0.0, 0.8))
    forward = compile_model(model, ctl, backend="eager") if compiled else model
    generator = torch.Generator().manual_seed(1)
    topologies = set()
    for _ in range(STEPS):
        topologies.add(tuple(sorted((g.name, g.count) for g in ctl.surgeon.groups)))
        x, y = torch.randn(8, 3, 32, 32, generator=generator), torch.randint(0, 10, (8,), generator=generator)
        torch.nn.functional.cross_entropy(forward(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return ctl, topologies, model


def test_compiled_training_matches_eager_and_compiles_once_per_topology():
    torch._dynamo.reset()
    eager, _, eager_model = train(compiled=False)
    counters.clear()
    compiled, topologies, compiled_model = train(compiled=True)
    assert compiled.events == eager.events and compiled.edits == eager.edits > 4
    assert compiled.tables["head"].ema.abs().sum() > 0  # scores were collected inside the compiled graph
    for (name, a), b in zip(eager_model.state_dict().items(), compiled_model.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)
    assert not counters["graph_break"], dict(counters["graph_break"])
    graphs = counters["stats"]["unique_graphs"]
    assert graphs - 1 <= compiled.edits + 1  # recompiles
    assert graphs >= len(topologies)  # every topology ran compiled: no fallback to eager at the recompile limit


def test_a_second_model_compiled_in_the_process_runs_its_own_score_taps():
    """dynamo reuses a frame's graph for another instance of a module class and, by default, does not guard on
    module hooks: once the first model's head taps are gone (after its last head proposal), a second wrapped GPT-2
    (its attention serves the call with a cache through its own forward, tapped by a hook) ran a graph without its
    taps, and the controller refused the step."""
    transformers = pytest.importorskip("transformers")
    torch._dynamo.reset()
    config = transformers.GPT2Config(vocab_size=30, n_positions=16, n_embd=16, n_layer=2, n_head=2, n_inner=4,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    ids = torch.randint(0, 30, (2, 7), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        call = {"input_ids": ids[:, :-1], "use_cache": True}
        ctl = barter.wrap(model, optimizer, total_steps=6, density=0.5, example_kwargs=call, window=(0.1, 0.9))
        forward = compile_model(model, ctl, backend="eager")
        for _ in range(4):  # past the head proposal at step 3, after which the head taps are removed
            logits = forward(**call).logits
            torch.nn.functional.cross_entropy(logits.reshape(-1, 30), ids[:, 1:].reshape(-1)).backward()
            optimizer.step()  # the controller checks that every layer's taps ran
            optimizer.zero_grad()
