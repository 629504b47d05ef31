"""Activation (gradient) checkpointing of a wrapped timm model (`set_grad_checkpointing`), eager and under
torch.compile: each block's attention (an installed forward with its score taps) runs again in the backward, and the
run is the run without checkpointing: the same transfers and weights, on non-zero scores."""
import pytest
import timm
import torch

import barter
from barter.compiling import compile_model

STEPS = 16


def train(*, checkpointing: bool, compiled: bool) -> tuple[barter.Controller, torch.nn.Module, int]:
    """STEPS steps of a tiny ViT through its transfers; also how many times its attentions ran."""
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2, embed_dim=64,
                              num_heads=4, num_classes=10)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ctl = barter.wrap(model, optimizer, total_steps=STEPS, density=0.5, window=(0.0, 0.8))
    model.set_grad_checkpointing(checkpointing)
    forward = compile_model(model, ctl, backend="eager") if compiled else model
    calls = []
    for block in model.blocks:
        block.attn.register_forward_pre_hook(lambda *_: calls.append(1))
    generator = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        x, y = torch.randn(8, 3, 32, 32, generator=generator), torch.randint(0, 10, (8,), generator=generator)
        torch.nn.functional.cross_entropy(forward(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return ctl, model, len(calls)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_checkpointed_training_recomputes_the_blocks_and_matches_the_plain_run(compiled: bool) -> None:
    if compiled:
        torch._dynamo.reset()
    plain, plain_model, plain_calls = train(checkpointing=False, compiled=False)
    checkpointed, model, calls = train(checkpointing=True, compiled=compiled)
    assert plain_calls == 2 * STEPS and calls == 2 * plain_calls  # each attention ran again in each backward
    assert checkpointed.events == plain.events and checkpointed.edits == plain.edits > 4
    assert checkpointed.tables["head"].ema.abs().sum() > 0 and checkpointed.tables["channel"].ema.abs().sum() > 0
    for kind in ("head", "channel"):
        torch.testing.assert_close(checkpointed.tables[kind].ema, plain.tables[kind].ema)
    for (name, a), b in zip(plain_model.state_dict().items(), model.state_dict().values()):
        torch.testing.assert_close(a, b, msg=name)
