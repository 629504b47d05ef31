"""Heads of ALiBi attention: per-head slopes the model computes once, at its head count, and hands to every
attention layer (added to the scores as (H, 1, S), or merged with the batch as (B·H, 1, S) under ``baddbmm``). Each
layer reads its kept heads' slopes through an index buffer of its own, a member of its heads' group: a removal equals
zeroing the head's output-projection columns and equals zeroing it at its tap, a clone leaves the outputs unchanged."""
from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn as nn

from fxsurgery import Surgeon
from tests.fxsurgery.test_fxsurgery_families_more import (
    HEAD_DIM,
    HEADS,
    HIDDEN,
    VOCAB,
    assert_head_1_removal_equals_masking,
)
from tests.zoo import assert_removal_masks_and_clone_keeps, masked_copy, masked_outputs

transformers = pytest.importorskip("transformers")  # the helpers shared with the Hugging Face families' tests


class AlibiAttention(nn.Module):
    """Attention whose scores get the per-head position bias it is handed: ``(H, 1, S)`` added to ``(B, H, S, S)``,
    or (``merged``) ``(B·H, 1, S)`` that ``baddbmm`` adds to the scores with the batch and heads merged."""

    def __init__(self, *, merged: bool):
        super().__init__()
        self.qkv, self.out = nn.Linear(HIDDEN, 3 * HIDDEN), nn.Linear(HIDDEN, HIDDEN)
        self.heads, self.merged = HEADS, merged

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = (t.view(b, n, self.heads, HEAD_DIM).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        if self.merged:
            flat = [t.reshape(b * self.heads, n, HEAD_DIM) for t in (q, k)]
            scores = bias.baddbmm(flat[0], flat[1].transpose(1, 2), beta=1.0, alpha=HEAD_DIM ** -0.5)
            scores = scores.view(b, self.heads, n, n)
        else:
            scores = q @ k.transpose(-1, -2) * HEAD_DIM ** -0.5 + bias[:, :, :n]
        return self.out((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, -1))


class AlibiModel(nn.Module):
    """Two blocks; the model computes the slopes once from its head count and hands the bias to every layer."""

    def __init__(self, *, merged: bool):
        super().__init__()
        torch.manual_seed(0)
        self.norms = nn.ModuleList(nn.LayerNorm(HIDDEN) for _ in range(2))
        self.attns = nn.ModuleList(AlibiAttention(merged=merged) for _ in range(2))
        self.heads, self.merged = HEADS, merged

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        slopes = 2.0 ** (-8.0 * torch.arange(1, self.heads + 1, dtype=x.dtype) / self.heads)
        bias = slopes[:, None, None] * torch.arange(n, dtype=x.dtype)[None, None, :]  # (H, 1, S)
        if self.merged:
            bias = bias.repeat(b, 1, 1)  # (B·H, 1, S)
        for norm, attn in zip(self.norms, self.attns):
            x = x + attn(norm(x), bias)
        return x


@pytest.mark.parametrize("merged", [False, True])
def test_heads_handed_slopes_computed_by_the_model_are_a_group_per_layer(merged: bool) -> None:
    """Each layer's heads are a group holding the layer's index buffer: removing head 1 equals zeroing its ``out``
    columns and equals zeroing it at the tap; a clone of head 0 keeps the outputs and the buffer says which heads'
    slopes the layer reads; kept heads (head 0 whole again from its two halves) and a layer at one head read their
    own slopes, through the installed graph and through the host's own forward (a hook inside the host)."""
    model = AlibiModel(merged=merged).double().eval()
    model_before = copy.deepcopy(model)
    x = torch.randn(2, 6, HIDDEN, dtype=torch.double)
    reference, by_weights = masked_outputs(model, x, "attns.1.out.weight", 1, HEAD_DIM)
    s = Surgeon(model, (x,))
    groups = sorted((g.name, g.count, g.exact) for g in s.groups if g.kind == "head")
    assert groups == [(f"attns.{i}:head", HEADS, True) for i in range(2)], s.explain()
    heads = s.group("attns.1:head")
    assert "attns.1.unit_index_0" in {sl.name for sl in heads.slices}
    assert_removal_masks_and_clone_keeps(s, heads, 1, lambda: model(x), by_weights=by_weights, reference=reference)
    assert model.state_dict()["attns.1.unit_index_0"].tolist() == [0, 2, 3, 0]
    s.keep(heads, [0, 3])  # head 0 whole again: its two halves
    s.keep(s.group("attns.0:head"), [2])  # a layer at one head
    dead = {"attns.1.out.weight": {1, 2, 3}, "attns.0.out.weight": {0, 1, 3}}
    only = masked_copy(model_before, dead, width=dict.fromkeys(dead, HEAD_DIM))
    assert model.state_dict()["attns.0.unit_index_0"].tolist() == [2]
    with torch.no_grad():
        assert (model(x) - only(x)).abs().max() < 1e-10
        model.attns[1].qkv.register_forward_hook(lambda module, args, out: None)  # its own forward serves the host
        assert (model(x) - only(x)).abs().max() < 1e-10
    assert "its own forward" in s.explain()


def tiny_mpt() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.MptConfig(d_model=HIDDEN, n_heads=HEADS, n_layers=2, vocab_size=VOCAB, max_seq_len=32,
                                    expansion_ratio=2)
    return transformers.MptForCausalLM(config).double().eval()


def tiny_bloom() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.BloomConfig(hidden_size=HIDDEN, n_head=HEADS, n_layer=2, vocab_size=VOCAB)
    return transformers.BloomForCausalLM(config).double().eval()


def tiny_falcon() -> nn.Module:
    """Falcon's multi-head attention with ALiBi, whose slopes (B·H, 1, S) are added to the scores inside it."""
    torch.manual_seed(0)
    config = transformers.FalconConfig(hidden_size=HIDDEN, num_attention_heads=HEADS, num_hidden_layers=2,
                                       vocab_size=VOCAB, alibi=True, multi_query=False,
                                       new_decoder_architecture=False)
    return transformers.FalconForCausalLM(config).double().eval()


def tiny_falcon_multi_query() -> nn.Module:
    """Falcon's multi-query attention with ALiBi: one key/value head beside the query heads in the fused projection,
    parallel attention and MLP; a unit is a query head (the key/value head stays)."""
    torch.manual_seed(0)
    config = transformers.FalconConfig(hidden_size=HIDDEN, num_attention_heads=HEADS, num_hidden_layers=2,
                                       vocab_size=VOCAB, alibi=True, multi_query=True, new_decoder_architecture=False,
                                       parallel_attn=True)
    return transformers.FalconForCausalLM(config).double().eval()


def zero_mpt_head_1(model: nn.Module) -> None:
    with torch.no_grad():
        model.transformer.blocks[1].attn.out_proj.weight[:, HEAD_DIM:2 * HEAD_DIM] = 0


def zero_bloom_head_1(model: nn.Module) -> None:
    with torch.no_grad():
        model.transformer.h[1].self_attention.dense.weight[:, HEAD_DIM:2 * HEAD_DIM] = 0


FAMILIES = {"mpt": (tiny_mpt, zero_mpt_head_1, "transformer.blocks.{}.attn:head"),
            "bloom": (tiny_bloom, zero_bloom_head_1, "transformer.h.{}.self_attention:head"),
            "falcon": (tiny_falcon, zero_bloom_head_1, "transformer.h.{}.self_attention:head"),
            "falcon_multi_query": (tiny_falcon_multi_query, zero_bloom_head_1, "transformer.h.{}.self_attention:head")}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_alibi_heads_are_a_group_per_layer(family: str) -> None:
    """MPT's attention, handed the slopes by its model (whose blocks return per-head weights, so the model hosts
    them), Bloom's and Falcon's: removing head 1 of a layer equals zeroing its output-projection columns and equals
    zeroing it at the tap; a clone of head 0 keeps the logits."""
    model, zero, layer = FAMILIES[family]
    model = model()
    assert_head_1_removal_equals_masking(model, lambda s: s.group(layer.format(1)), zero)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_alibi_cached_generate_after_a_removal_and_a_clone_equals_masking(family: str) -> None:
    """Every layer's heads are an exact group; after a removal and a clone, decoding from the cache (served by the
    host's own forward, which gathers the slopes it hands on as the graph does) and ``generate`` with the cache equal
    the masked model and ``generate`` without, in the model, a copy and a pickled one."""
    from tests.fxsurgery.test_fxsurgery_fused_qkv_pieces import assert_decodes_as_masked

    model, zero, layer = FAMILIES[family]
    model = model()
    masked = copy.deepcopy(model)
    zero(masked)
    ids = torch.randint(3, VOCAB, (2, 5), generator=torch.Generator().manual_seed(0))
    s = Surgeon(model, (), {"input_ids": ids})
    assert sorted((g.name, g.exact) for g in s.groups if g.kind == "head") == [(layer.format(i), True)
                                                                                for i in range(2)], s.explain()
    heads = s.group(layer.format(1))
    s.remove(heads, 1)
    s.clone(heads, 0, noise_std=0.1)
    more = torch.randint(3, VOCAB, (2, 2), generator=torch.Generator().manual_seed(1))
    for served in (model, copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert_decodes_as_masked(served, masked, ids, more)


OUTPUT_PROJECTIONS = {"mpt": "transformer.blocks.{}.attn.out_proj", "bloom": "transformer.h.{}.self_attention.dense",
                      "falcon": "transformer.h.{}.self_attention.dense",
                      "falcon_multi_query": "transformer.h.{}.self_attention.dense"}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_alibi_first_layer_emptied_decodes_from_its_cache_as_masked(family: str) -> None:
    """The first layer left with no heads: the call that makes the cache (MPT's graph returns it, the whole model
    captured by torch.export) stores one zero head for it, as the calls that pass the cache back do, so decoding from
    the cache and cached ``generate`` equal the model with that layer's output-projection weight zeroed (an empty
    entry would read as an empty cache, and the next call's zero head would not match it)."""
    from tests.fxsurgery.test_fxsurgery_fused_qkv_pieces import assert_decodes_as_masked

    model, _, layer = FAMILIES[family]
    model = model()
    masked = copy.deepcopy(model)
    with torch.no_grad():
        masked.get_submodule(OUTPUT_PROJECTIONS[family].format(0)).weight.zero_()
    s = Surgeon(model, (), {"input_ids": torch.randint(3, VOCAB, (2, 5), generator=torch.Generator().manual_seed(0))})
    first = s.group(layer.format(0))
    s.keep(first, [])
    assert first.count == 0
    ids = torch.randint(3, VOCAB, (2, 5), generator=torch.Generator().manual_seed(2))
    more = torch.randint(3, VOCAB, (2, 2), generator=torch.Generator().manual_seed(3))
    cached = assert_decodes_as_masked(model, masked, ids, more)
    assert cached.past_key_values.get_seq_length() == ids.shape[1] + more.shape[1]  # the decoding call added to it


def test_slopes_whose_heads_fail_their_self_check_are_read_whole_and_kept_out_of_the_state_dict(monkeypatch,
                                                                                                  tmp_path) -> None:
    """A head group that fails its self-check is left out; its layer keeps reading every head's slope through its
    index buffer, which stays out of the state_dict (no group edits it), so the model exports and loads as built."""
    import barter
    import fxsurgery.analysis.install as install
    from fxsurgery import UnitKind
    from fxsurgery.reason import Reason

    checked = install.self_check
    monkeypatch.setattr(install, "self_check", lambda editor, g, inputs: Reason("refused by the test")
                        if g.kind == UnitKind.HEAD else checked(editor, g, inputs))
    model = tiny_mpt()
    ids = torch.randint(3, VOCAB, (2, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    ctl = barter.wrap(model, total_steps=10, density=0.5, example_kwargs={"input_ids": ids})
    assert not [g for g in ctl.surgeon.groups if g.kind == UnitKind.HEAD]
    assert "refused by the test" in ctl.surgeon.explain()
    buffers = {name for name, _ in model.named_buffers() if "unit_index" in name}
    assert buffers and not buffers & set(model.state_dict())
    channels = ctl.surgeon.group("transformer.blocks.0.ffn:channel")
    assert channels.count < channels.max_count  # the wrap made the channels compact, the heads whole
    loaded = barter.load(barter.export(model, tmp_path / "model", program=False))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)
        assert not torch.equal(model(input_ids=ids).logits, expected)
