"""A model built on the meta device (no memory for its weights) is analysed from its shapes and graphs alone: the
same groups, counts, constants and refusals as the same model built on the CPU, its self-check run on random values
of its hosts' shapes; the self-check still fails a group built to be wrong, and the model stays on meta."""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from tiny_vit import build_vit

from fxsurgery import Surgeon, analyse
from fxsurgery.analysis.verify import real_values, self_check


def _built(device: str) -> torch.nn.Module:
    with torch.device(device):
        return build_vit()


def _host_call(surgeon: Surgeon, group, x: torch.Tensor) -> tuple[tuple, dict]:
    """The call the group's host gets when the model runs on ``x`` (what the self-check replays)."""
    calls = []
    handle = surgeon.model.get_submodule(group.module).register_forward_pre_hook(
        lambda module, args, kwargs: calls.append((args, kwargs)), with_kwargs=True)
    surgeon.model(x)
    handle.remove()
    return calls[0]


def _described(analysis) -> tuple:
    groups = [(g.name, g.kind, g.count, g.max_count, g.min_count, g.exact, tuple((sl.name, sl.dim, sl.output)
               for sl in g.slices)) for g in analysis.groups]
    return groups, analysis.left_out, analysis.front_ends, analysis.structure


def test_a_meta_model_analyses_as_the_same_model_on_the_cpu() -> None:
    meta, cpu = _built("meta"), _built("cpu")
    on_meta = analyse(meta, (torch.zeros(2, 3, 32, 32, device="meta"),))
    on_cpu = analyse(cpu, (torch.zeros(2, 3, 32, 32),))
    assert len(on_meta.groups) == 6
    assert _described(on_meta) == _described(on_cpu)
    assert all(t.is_meta for t in [*meta.parameters(), *meta.buffers()])


def test_real_values_stand_in_for_meta_tensors_and_leave_them_meta() -> None:
    model = _built("meta")
    block = model.blocks[0]
    weight = block.attn.qkv.weight
    with real_values(block):
        real = block.attn.qkv.weight
        assert not real.is_meta and real.shape == (192, 64) and isinstance(real, torch.nn.Parameter)
        assert torch.isfinite(block(torch.randn(2, 17, 64))).all()
    assert block.attn.qkv.weight is weight and all(t.is_meta for t in block.parameters())


def test_real_values_keep_tied_parameters_tied() -> None:
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight
    with real_values(model):
        assert model[1].weight is model[0].weight and not model[0].weight.is_meta
    assert model[1].weight is model[0].weight and model[0].weight.is_meta


def test_the_self_check_fails_a_wrong_group_on_a_meta_model() -> None:
    x = torch.zeros(2, 3, 32, 32, device="meta")
    s = Surgeon(_built("meta"), (x,))
    g = s.group("blocks.0.attn:head")
    calls = [_host_call(s, g, x)]
    assert self_check(s._editor, g, calls[0]) is None
    g._state.slices = tuple(dataclasses.replace(sl, output=False) for sl in g.slices)  # the columns copied, not split
    assert self_check(s._editor, g, calls[0]).text.startswith("a clone changed the outputs by")
    assert all(t.is_meta for t in s.model.parameters())


def test_a_meta_hf_llama_analyses_as_on_the_cpu() -> None:
    """Its attention takes a tuple of tensors: captured by torch.export on meta inputs, the replay check and the
    self-check on real values standing in."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=50, num_key_value_heads=2, max_position_embeddings=32,
                                      use_cache=False, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=24)
    ids = torch.zeros(2, 6, dtype=torch.long)
    with torch.device("meta"):
        meta = transformers.LlamaModel(config)
    on_meta = analyse(meta, (), {"input_ids": ids.to("meta")})
    on_cpu = analyse(transformers.LlamaModel(config), (), {"input_ids": ids})
    assert [g.name for g in on_meta.groups] == [g.name for g in on_cpu.groups]
    assert len(on_meta.groups) == 4 and _described(on_meta)[0] == _described(on_cpu)[0]


def test_an_analysis_of_the_meta_model_installs_on_the_model_built_real() -> None:
    """The analysis of the meta-built model (its example call on meta) installs on the same model built on the
    CPU, whose first call runs on real values of the example's shapes: removing a head there equals zeroing its
    columns of the output projection (16 per head) in a copy of the real model."""
    on_meta = analyse(_built("meta"), (torch.zeros(2, 3, 32, 32, device="meta"),))
    model = _built("cpu").eval()
    masked = copy.deepcopy(model)
    surgeon = Surgeon(model, on_meta)
    assert [(g.name, g.count) for g in surgeon.groups] == [(g.name, g.count) for g in on_meta.groups]
    assert not surgeon.example_inputs[0].is_meta and on_meta.example_inputs[0].is_meta  # the analysis stays as it was
    surgeon.remove(surgeon.group("blocks.1.attn:head"), 2)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        masked.blocks[1].attn.proj.weight[:, 32:48] = 0
        torch.testing.assert_close(model(x), masked(x), rtol=1e-5, atol=1e-6)


def test_a_meta_group_is_checked_on_a_few_unit_twin_that_still_fails_when_wrong(monkeypatch) -> None:
    """The stand-ins of a wide group are made at a few units (a block of a large model would be GBs at full width);
    the twin still catches a wrong group, and the meta model keeps its count and shapes."""
    from fxsurgery.analysis import verify
    from fxsurgery.capture import calls as capture_calls
    x = torch.zeros(2, 3, 32, 32, device="meta")
    s = Surgeon(_built("meta"), (x,))
    g = s.group("blocks.0.mlp:channel")
    calls = [_host_call(s, g, x)]
    made = []
    materialize = capture_calls.materialize
    monkeypatch.setattr(capture_calls, "materialize", lambda t, seed=0: made.append(tuple(t.shape)) or
                        materialize(t, seed))
    assert g.count == 64 and self_check(s._editor, g, calls[0]) is None
    assert (verify.TWIN_UNITS, 64) in made and (64, 64) not in made  # fc1's weight at 4 units, not 64
    g._state.slices = tuple(dataclasses.replace(sl, output=False) for sl in g.slices)  # the columns copied, not split
    assert self_check(s._editor, g, calls[0]).text.startswith("a clone changed the outputs by")
    fc1 = s.model.get_submodule("blocks.0.mlp.fc1")
    assert g.count == 64 and fc1.weight.shape == (64, 64) and fc1.out_features == 64
    assert all(t.is_meta for t in s.model.parameters())
