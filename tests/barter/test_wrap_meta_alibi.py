"""A model whose install adds index buffers (each layer reads its kept heads' ALiBi slopes through one), wrapped on
the meta device: no build makes those buffers, so `to_empty` leaves them unset. The wrap's controller writes them at
the first call once allocated, and `meta_build.materialise` as it replays the build: either way the model computes
what the same model wrapped with its weights computes."""
from __future__ import annotations

import pytest
import torch

import barter
from barter.meta_build import materialise, record_build
from tests.fxsurgery.test_fxsurgery_alibi import AlibiAttention, AlibiModel
from tests.fxsurgery.test_fxsurgery_families_more import HEAD_DIM, HEADS, HIDDEN

OPTIONS = dict(total_steps=12, density=0.5, init="first", head_ratio=0.5, channel_ratio=0.5)
X = torch.randn(2, 6, HIDDEN)


class TracedAlibiAttention(AlibiAttention):
    """The same attention, written so that a symbolic trace (on meta, the one capture that needs no values) runs."""

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        qkv = self.qkv(x).view(b, n, 3, HEADS, HEAD_DIM).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        if self.merged:
            scores = bias.baddbmm(q.reshape(b * HEADS, n, HEAD_DIM), k.reshape(b * HEADS, n, HEAD_DIM).transpose(1, 2),
                                  beta=1.0, alpha=HEAD_DIM ** -0.5).view(b, HEADS, n, n)
        else:
            scores = q @ k.transpose(-1, -2) * HEAD_DIM ** -0.5 + bias[:, :, :n]
        return self.out((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, -1))


def _model(merged: bool) -> torch.nn.Module:
    model = AlibiModel(merged=merged)
    model.attns = torch.nn.ModuleList(TracedAlibiAttention(merged=merged) for _ in range(2))
    return model


def _wrapped(model: torch.nn.Module, device: str) -> barter.Controller:
    return barter.wrap(model, example_inputs=(X.to(device),), **OPTIONS)


def _indices(model: torch.nn.Module) -> dict[str, list[int]]:
    return {name: b.tolist() for name, b in model.named_buffers() if "unit_index" in name}


@pytest.mark.parametrize("merged", [False, True])
def test_a_meta_model_with_index_buffers_computes_as_the_one_wrapped_with_weights(merged: bool) -> None:
    direct = _wrapped(_model(merged), "cpu")
    assert _indices(direct.model) == {f"attns.{i}.unit_index_0": [0, 1] for i in range(2)}
    with torch.device("meta"):
        built = _model(merged)
    on_meta = _wrapped(built, "meta")
    on_meta.model.to_empty(device="cpu")
    weights = {k: v for k, v in direct.model.state_dict().items() if "unit_index" not in k}
    on_meta.model.load_state_dict(weights, strict=False)
    with torch.no_grad():
        assert torch.equal(on_meta.model(X), direct.model(X))
    assert _indices(on_meta.model) == _indices(direct.model)


def test_materialise_writes_the_index_buffers_the_build_did_not_make() -> None:
    direct = _wrapped(_model(False), "cpu")
    model, record = record_build(lambda: _model(False))
    ctl = _wrapped(model, "meta")
    materialise(model, record, "cpu", controller=ctl)
    assert _indices(model) == _indices(direct.model)
    with torch.no_grad():
        assert torch.equal(model(X), direct.model(X))


def test_a_meta_hf_model_captured_by_export_computes_as_the_one_wrapped_with_weights() -> None:
    """MPT (ALiBi, captured by torch.export) wrapped on meta finds the heads it finds with weights, and once allocated
    and given the same weights computes the same logits: its graph makes its tensors where the model is now."""
    transformers = pytest.importorskip("transformers")
    config = transformers.MptConfig(d_model=HIDDEN, n_heads=HEADS, n_layers=2, vocab_size=64, max_seq_len=32,
                                    expansion_ratio=2)
    ids = torch.randint(3, 64, (2, 7), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    direct = barter.wrap(transformers.MptForCausalLM(config), example_kwargs={"input_ids": ids}, **OPTIONS)
    with torch.device("meta"):
        built = transformers.MptForCausalLM(config)
    on_meta = barter.wrap(built, example_kwargs={"input_ids": ids.to("meta")}, **OPTIONS)
    assert [g.name for g in on_meta.surgeon.groups] == [g.name for g in direct.surgeon.groups]
    on_meta.model.to_empty(device="cpu")
    on_meta.model.load_state_dict({k: v for k, v in direct.model.state_dict().items() if "unit_index" not in k},
                                  strict=False)
    with torch.no_grad():
        assert torch.equal(on_meta.model(input_ids=ids).logits, direct.model(input_ids=ids).logits)
    assert _indices(on_meta.model) == _indices(direct.model)
