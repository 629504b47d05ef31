"""Heads of transformers' families whose attention the sweep (benchmarks/hf_sweep.py) found without heads, built
tiny from their configs: Doge (each key/value head's values also read by ``dt_proj``, which makes every head's
dynamic mask), CpmAnt and MPNet (a position bias made once and added to every layer's scores: one head index over
the layers, as T5's), RoFormer (rotary positions looked up in a frozen table once for all layers). Removal of a head
equals zeroing the columns of every map that reads it and equals zeroing it at its tap; a clone leaves the outputs
unchanged."""
from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn as nn

from fxsurgery import AnalysisError, Surgeon, UnitGroup

transformers = pytest.importorskip("transformers")
HIDDEN, HEADS, HEAD_DIM, VOCAB, LENGTH = 32, 4, 8, 64, 7


def tiny_doge() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.DogeConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=48, num_hidden_layers=2,
                                     num_attention_heads=HEADS, num_key_value_heads=2, max_position_embeddings=32,
                                     use_cache=False)  # a cache object passed in is served by the own forward
    model = transformers.DogeForCausalLM(config).double().eval()
    with torch.no_grad():
        for layer in model.model.layers:  # A starts at zero, which makes every mask one constant
            layer.self_attn.A.normal_()
    return model


def tiny_cpmant() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.CpmAntConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_attention_heads=HEADS,
                                       dim_head=HEAD_DIM, dim_ff=48, num_hidden_layers=2, prompt_length=4,
                                       position_bias_num_buckets=16, position_bias_max_distance=32)
    return transformers.CpmAntForCausalLM(config).double().eval()


def assert_head_1_removal_equals_masking(model: nn.Module, group: Callable[[Surgeon], UnitGroup],
                                         zero_head_1: Callable[[nn.Module], None], tol: float = 1e-10) -> None:
    """On ``model``: removing unit 1 of the group equals ``zero_head_1`` (the weights' oracle, on a copy) and equals
    zeroing it at the tap, within ``tol``; it changes the logits; cloning unit 0 afterwards keeps them."""
    ids = torch.randint(3, VOCAB, (2, LENGTH), generator=torch.Generator().manual_seed(0))
    call = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    zeroed = copy.deepcopy(model)
    with torch.no_grad():
        reference = model(**call).logits
        zero_head_1(zeroed)
        by_weights = zeroed(**call).logits
    s = Surgeon(model, (), call)
    heads = group(s)
    handle = s.tap(heads, lambda a: a.select(-2, 1).zero_())
    with torch.no_grad():
        tapped = model(**call).logits
    handle.remove()
    s.remove(heads, 1)
    assert heads.count == heads.max_count - 1
    with torch.no_grad():
        removed = model(**call).logits
    assert (removed - by_weights).abs().max() < tol and (removed - tapped).abs().max() < tol
    assert not torch.allclose(removed, reference, atol=1e-6)
    s.clone(heads, 0, noise_std=0.1)
    with torch.no_grad():
        assert (model(**call).logits - removed).abs().max() < tol


def test_doge_heads_whose_values_make_the_dynamic_mask_are_a_group_per_layer() -> None:
    """A unit is one key/value head with its two query heads; ``dt_proj`` reads its values (as ``o_proj`` reads its
    output) and makes its mask from all of them: a removal zeroes the head at both reads."""
    model = tiny_doge()
    s = Surgeon(copy.deepcopy(model), (), {"input_ids": torch.randint(3, VOCAB, (2, LENGTH))})
    heads = sorted((g.name, g.count, g.exact) for g in s.groups if g.kind == "head")
    assert heads == [(f"model.layers.{i}.self_attn:head", 2, True) for i in range(2)], s.explain()
    layer = next(g for g in s.groups if g.name == "model.layers.0.self_attn:head")
    assert {"model.layers.0.self_attn.dt_proj.weight", "model.layers.0.self_attn.A"} <= \
        {sl.name for sl in layer.slices}

    def zero_head_1(copied: nn.Module) -> None:
        attention = copied.model.layers[0].self_attn
        attention.o_proj.weight[:, 2 * HEAD_DIM:] = 0  # query heads 2 and 3 read key/value head 1
        attention.dt_proj.weight[:, HEAD_DIM:] = 0

    assert_head_1_removal_equals_masking(model, lambda s: s.group("model.layers.0.self_attn:head"), zero_head_1)


def tiny_mpnet() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.MPNetConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2,
                                      num_attention_heads=HEADS, intermediate_size=48, max_position_embeddings=32)
    return transformers.MPNetForMaskedLM(config).double().eval()


SHARED_BIAS = {  # family -> (tiny model, the output projection of layer i)
    "cpmant": (tiny_cpmant, "cpmant.encoder.layers.{}.self_att.self_attention.attention_out.weight"),
    "mpnet": (tiny_mpnet, "mpnet.encoder.layer.{}.attention.attn.o.weight"),
}


@pytest.mark.parametrize("family", list(SHARED_BIAS))
def test_heads_that_share_the_position_bias_of_every_layer_are_one_group(family: str) -> None:
    """CpmAnt and MPNet add one relative-position bias, made once, to every layer's scores (a sum before the
    attention's product, no stream): one head index over the layers is a unit."""
    build, projection = SHARED_BIAS[family]
    projections = [projection.format(i) for i in range(2)]

    def zero_head_1(copied: nn.Module) -> None:
        for name in projections:
            copied.get_parameter(name)[:, HEAD_DIM:2 * HEAD_DIM] = 0

    def heads(s: Surgeon) -> UnitGroup:
        (group,) = [g for g in s.groups if g.kind == "head"]
        assert (group.count, group.exact) == (HEADS, True), s.explain()
        assert sorted(sl.name for sl in group.slices if sl.name in projections) == projections
        return group

    assert_head_1_removal_equals_masking(build(), heads, zero_head_1)


def tiny_roformer() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.RoFormerConfig(vocab_size=VOCAB, hidden_size=HIDDEN, embedding_size=HIDDEN,
                                         num_hidden_layers=2, num_attention_heads=HEADS, intermediate_size=48,
                                         max_position_embeddings=32)
    return transformers.RoFormerForMaskedLM(config).double().eval()


def test_heads_rotated_by_a_position_table_looked_up_once_are_a_group_per_layer() -> None:
    """RoFormer looks its rotary sines and cosines up in a frozen embedding table, by positions made from the length
    alone, once for all layers; every head multiplies the same table columns. The table is shared by the heads, not a
    unit space of its own: each layer's heads are a group, removal equals masking, and the lookup is left whole."""
    model = tiny_roformer()
    projection = "roformer.encoder.layer.0.attention.output.dense.weight"

    def zero_head_1(copied: nn.Module) -> None:
        copied.get_parameter(projection)[:, HEAD_DIM:2 * HEAD_DIM] = 0

    def heads(s: Surgeon) -> UnitGroup:
        found = sorted((g.name, g.count, g.exact) for g in s.groups if g.kind == "head")
        assert found == [(f"roformer.encoder.layer.{i}.attention:head", HEADS, True) for i in range(2)], s.explain()
        group = s.group("roformer.encoder.layer.0.attention:head")
        assert not any("embed_positions" in sl.name for g in s.groups for sl in g.slices)
        assert projection in {sl.name for sl in group.slices}
        return group

    assert_head_1_removal_equals_masking(model, heads, zero_head_1)


class Routed(nn.Module):
    """A router's logits, one per expert, pick the top two experts whose outputs (an expert's map each) are mixed by
    the routing weights: which experts the data picks depends on all of them."""

    def __init__(self, dim: int = 6, experts: int = 3):
        super().__init__()
        self.router = nn.Linear(dim, experts)
        self.experts = nn.ModuleList(nn.Linear(dim, dim) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = self.router(x).topk(2, dim=-1)
        outputs = torch.stack([expert(x) for expert in self.experts], dim=-2)  # [.., experts, dim]
        picked = outputs.gather(-2, chosen.unsqueeze(-1).expand(*chosen.shape, x.shape[-1]))
        return x + (weights.softmax(-1).unsqueeze(-1) * picked).sum(-2)


def test_units_a_router_chooses_among_by_top_k_are_refused_saying_why() -> None:
    """The router's top-k (JetMoE's mixture of attention heads, a mixture of experts) is told as the data's choice among
    units, which no removal can equal masking, not as an op without a rule."""
    torch.manual_seed(0)
    with pytest.raises(AnalysisError) as refused:
        Surgeon(Routed(), (torch.randn(2, 5, 6),))
    assert "router: topk_2: a top-k choice among units that the data makes (a router picking experts): removing one " \
        "would change which of the others are picked, so no removal equals masking it" in str(refused.value)
    assert "no rule for topk" not in str(refused.value)


def tiny_llama4() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.Llama4TextConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=48,
                                           intermediate_size_mlp=48, num_hidden_layers=2, num_attention_heads=HEADS,
                                           num_key_value_heads=2, head_dim=HEAD_DIM, max_position_embeddings=32,
                                           num_local_experts=2, num_experts_per_tok=1, attention_chunk_size=4,
                                           use_cache=False)
    return transformers.Llama4ForCausalLM(config).double().eval()


def test_llama4_heads_rotated_in_complex_form_are_a_group_per_layer() -> None:
    """Llama 4 rotates q and k as complex pairs (``view_as_complex``, times one rotation per position,
    ``view_as_real``), in chunked attention beside a mixture of experts: a unit is one key/value head with its two
    query heads, and its removal equals zeroing their columns of ``o_proj`` (to float32's precision: the model
    normalises and rotates in float32 whatever its dtype)."""
    projection = "model.layers.0.self_attn.o_proj.weight"

    def zero_head_1(copied: nn.Module) -> None:
        copied.get_parameter(projection)[:, 2 * HEAD_DIM:] = 0  # query heads 2 and 3 read key/value head 1

    def heads(s: Surgeon) -> UnitGroup:
        found = sorted((g.name, g.count, g.exact) for g in s.groups if g.kind == "head")
        assert found == [(f"model.layers.{i}.self_attn:head", 2, True) for i in range(2)], s.explain()
        return s.group("model.layers.0.self_attn:head")

    assert_head_1_removal_equals_masking(tiny_llama4(), heads, zero_head_1, tol=1e-6)


def tiny_diffllama(heads: int, key_value_heads: int) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.DiffLlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=48,
                                          num_hidden_layers=2, num_attention_heads=heads,
                                          num_key_value_heads=key_value_heads, head_dim=4, max_position_embeddings=32,
                                          use_cache=False)
    return transformers.DiffLlamaForCausalLM(config).double().eval()


@pytest.mark.parametrize("heads, key_value_heads", [(8, 4), (12, 6), (8, 8)])
def test_differential_heads_paired_across_the_halves_are_a_group_per_layer(heads: int, key_value_heads: int) -> None:
    """DiffLlama's output head j subtracts the attention of query head j + heads/2 from that of query head j, over
    values made of key/value heads k and k + kv/2 (chunked, concatenated and repeated): a unit holds two key/value heads
    with their query heads, and writes the ``o_proj`` columns of its output heads (each 2 · head_dim wide). Removing
    unit 1 equals zeroing those columns and equals zeroing it at the tap; a clone keeps the logits."""
    queries_per_kv, width = heads // key_value_heads, 2 * 4
    units = key_value_heads // 2
    projection = "model.layers.0.self_attn.o_proj.weight"

    def zero_head_1(copied: nn.Module) -> None:
        for output_head in range(heads // 2):
            if (output_head // queries_per_kv) % units == 1:
                copied.get_parameter(projection)[:, output_head * width:(output_head + 1) * width] = 0

    def group(s: Surgeon) -> UnitGroup:
        found = sorted((g.name, g.count, g.exact) for g in s.groups if g.kind == "head")
        assert found == [(f"model.layers.{i}.self_attn:head", units, True) for i in range(2)], s.explain()
        return s.group("model.layers.0.self_attn:head")

    assert_head_1_removal_equals_masking(tiny_diffllama(heads, key_value_heads), group, zero_head_1)
