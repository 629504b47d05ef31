"""Heads of multi-head latent attention (DeepSeek V3's form): keys and values are made per head from a compressed
latent (``kv_b_proj``), and every head's key ends with one rotary part all heads share (rows of ``kv_a_proj_with_mqa``,
broadcast to every head). The keys are assembled in place (``new_empty``, then two slice ``copy_``), which the
capture reads as the concatenation it is; the shared part joins no head, its repeat to the head count follows the
count. A head is its rows of the query and ``kv_b_proj`` maps and its columns of ``o_proj``: removal equals zeroing
those columns and equals zeroing the head at its tap, a clone keeps the logits, decoding from the cache equals the
masked model."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.fx
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

from fxsurgery import Surgeon
from fxsurgery.capture.slice_fills import fills_as_concatenation
from tests.fxsurgery.test_fxsurgery_families_more import HEADS, HIDDEN, VOCAB, assert_head_1_removal_equals_masking
from tests.fxsurgery.test_fxsurgery_fused_qkv_pieces import assert_decodes_as_masked

transformers = pytest.importorskip("transformers")
VALUE_DIM = 6  # unlike the key's 4 + 4: a slice of o_proj by the wrong width shows
LAYER = "model.layers.{}.self_attn:head"


def tiny_deepseek_v3(*, query_rank: int | None) -> nn.Module:
    """Two dense layers; ``query_rank`` None: queries from ``q_proj``, else through a low-rank ``q_a``/``q_b`` pair."""
    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=48,
                                           num_hidden_layers=2, num_attention_heads=HEADS,
                                           num_key_value_heads=HEADS, q_lora_rank=query_rank, kv_lora_rank=12,
                                           qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=VALUE_DIM,
                                           first_k_dense_replace=2, max_position_embeddings=32)
    return transformers.DeepseekV3ForCausalLM(config).double().eval()


def zero_head_1(model: nn.Module, layer: int = 1) -> None:
    with torch.no_grad():
        model.model.layers[layer].self_attn.o_proj.weight[:, VALUE_DIM:2 * VALUE_DIM] = 0


@pytest.mark.parametrize("query_rank", [None, 8])
def test_latent_attention_heads_are_a_group_per_layer(query_rank: int | None) -> None:
    """Each layer's heads are an exact group of its query rows, its ``kv_b_proj`` rows and ``o_proj`` columns; the
    shared rotary rows of ``kv_a_proj_with_mqa`` and the latent stay whole. Removing head 1 equals both oracles and a
    clone of head 0 keeps the logits."""
    model = tiny_deepseek_v3(query_rank=query_rank)
    ids = torch.randint(3, VOCAB, (2, 5), generator=torch.Generator().manual_seed(0))
    s = Surgeon(copy.deepcopy(model), (), {"input_ids": ids})
    heads = sorted((g.name, g.count, g.exact) for g in s.groups if g.kind == "head")
    assert heads == [(LAYER.format(i), HEADS, True) for i in range(2)], s.explain()
    sliced = {sl.name for sl in s.group(LAYER.format(1)).slices}
    query = "q_proj" if query_rank is None else "q_b_proj"
    assert {f"model.layers.1.self_attn.{name}.weight" for name in (query, "kv_b_proj", "o_proj")} <= sliced
    assert not any("kv_a_proj_with_mqa" in name or "q_a_proj" in name for name in sliced)
    assert_head_1_removal_equals_masking(model, lambda surgeon: surgeon.group(LAYER.format(1)), zero_head_1)


def test_latent_attention_decodes_from_its_cache_as_masked() -> None:
    """After a removal and a clone in one layer and the other layer emptied, decoding from the cache (the latent and
    the shared rotary key, which no head owns) and cached ``generate`` equal the masked model."""
    model = tiny_deepseek_v3(query_rank=8)
    masked = copy.deepcopy(model)
    zero_head_1(masked)
    with torch.no_grad():
        masked.model.layers[0].self_attn.o_proj.weight.zero_()
    ids = torch.randint(3, VOCAB, (2, 5), generator=torch.Generator().manual_seed(0))
    s = Surgeon(model, (), {"input_ids": ids})
    heads = s.group(LAYER.format(1))
    s.remove(heads, 1)
    s.clone(heads, 0, noise_std=0.1)
    s.keep(s.group(LAYER.format(0)), [])
    more = torch.randint(3, VOCAB, (2, 2), generator=torch.Generator().manual_seed(1))
    assert_decodes_as_masked(model, masked, ids, more)


class InPlaceAssembly(nn.Module):
    """A tensor made fresh and filled piece by piece, in ways that are (``how="tiled"``) and are not a
    concatenation: a gap left, a piece read before the fill ends, a piece broadcast into its slice."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        out = a.new_empty(a.shape[0], 6)
        out[:, :2].copy_(a)
        if self.how == "read_early":
            early = out[:, :2] * 2
        if self.how == "broadcast":
            out[:, 2:].copy_(b[:, :1])
        elif self.how != "gap":
            out[:, 2:].copy_(b)
        return out + 1 if self.how != "read_early" else out[:, :2] + early


@pytest.mark.parametrize("how, rewritten", [("tiled", True), ("gap", False), ("read_early", False),
                                            ("broadcast", False)])
def test_only_an_exact_tiling_of_a_fresh_tensor_becomes_a_concatenation(how: str, rewritten: bool) -> None:
    """The rewrite replaces ``new_empty`` and its ``copy_`` writes by one ``cat`` only where the writes tile the
    tensor, each of its slice's shape, before anything reads it; the rewritten graph computes what the module does."""
    module = InPlaceAssembly(how)
    a, b = torch.randn(3, 2), torch.randn(3, 4)
    graph = torch.export.export(module, (a, b)).graph_module
    fills_as_concatenation(graph.graph)
    graph.recompile()
    targets = {node.target for node in graph.graph.nodes if node.op == "call_function"}
    assert (torch.ops.aten.cat.default in targets) == rewritten
    assert (torch.ops.aten.copy_.default in targets) != rewritten
    if how != "gap":  # a gap is uninitialised memory: no value to compare
        assert torch.equal(graph(a, b)[0], module(a, b))


class PieceByPiece(nn.Module):
    """A fresh tensor of ``sum(widths)`` along ``dim`` filled by one slice ``copy_`` per input, in the order
    ``order``, then read."""

    def __init__(self, widths: list[int], dim: int, order: list[int]):
        super().__init__()
        self.widths, self.dim, self.order = widths, dim, order

    def forward(self, *pieces: torch.Tensor) -> torch.Tensor:
        shape = list(pieces[0].shape)
        shape[self.dim] = sum(self.widths)
        out = pieces[0].new_empty(shape)
        starts = [sum(self.widths[:k]) for k in range(len(self.widths))]
        for k in self.order:
            out[(slice(None),) * self.dim + (slice(starts[k], starts[k] + self.widths[k]),)].copy_(pieces[k])
        return out.sin()


@settings(max_examples=15)
@given(widths=st.lists(st.integers(1, 3), min_size=1, max_size=4), dim=st.integers(0, 2), data=st.data())
def test_any_exact_tiling_in_any_order_is_captured_as_the_concatenation(widths, dim, data) -> None:
    """Pieces of any widths written along any dim, in any order: the captured graph has one ``cat`` and no ``copy_``,
    and computes what the module does."""
    order = data.draw(st.permutations(range(len(widths))))
    module = PieceByPiece(widths, dim, list(order))
    pieces = []
    for width in widths:
        shape = [2, 3, 4]
        shape[dim] = width
        pieces.append(torch.randn(shape))
    graph = torch.export.export(module, tuple(pieces)).graph_module
    fills_as_concatenation(graph.graph)
    graph.recompile()
    targets = [node.target for node in graph.graph.nodes if node.op == "call_function"]
    assert torch.ops.aten.cat.default in targets and torch.ops.aten.copy_.default not in targets
    assert torch.equal(graph(*pieces)[0], module(*pieces))
