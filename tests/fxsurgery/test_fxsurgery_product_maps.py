"""Hugging Face attentions whose linear maps are products with parameters: XLNet's einsums over (d_model, heads,
head_dim) weights (``einsum("ibh,hnd->ibnd", h, q)``, read back by ``einsum("ibnd,hnd->ibh", v, o)``) and Falcon's
``x @ self.weight.T``. Each head group is checked against two oracles built without fxsurgery's slices: removing
heads equals zeroing their columns of the output weight on a copy of the dense model, and equals zeroing their
activations through ``Surgeon.tap``; a clone leaves the outputs unchanged. Models are built from tiny configs,
offline."""
from __future__ import annotations

import copy

import pytest
import torch

import fxsurgery
from fxsurgery import Surgeon

transformers = pytest.importorskip("transformers")

TOKENS = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(0))


def xlnet(cls: str) -> torch.nn.Module:
    config = transformers.XLNetConfig(vocab_size=100, d_model=32, n_layer=2, n_head=4, d_inner=48)
    return getattr(transformers, cls)(config)


def falcon(**options) -> torch.nn.Module:
    config = transformers.FalconConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                       **options)
    return transformers.FalconForCausalLM(config)


def zero_xlnet_heads(model: torch.nn.Module, layer: str, dead: list[int]) -> None:
    """XLNet's output weight ``o`` is (d_model, heads, head_dim): a head's columns are its index along dim 1."""
    model.get_parameter(f"{layer}.o")[:, dead, :] = 0


def zero_falcon_heads(model: torch.nn.Module, layer: str, dead: list[int], count: int) -> None:
    """Falcon's ``dense`` reads the heads side by side: a unit's columns are a run of hidden / count."""
    weight = model.get_parameter(f"{layer}.dense.weight")
    width = weight.shape[1] // count
    for unit in dead:
        weight[:, unit * width:(unit + 1) * width] = 0


def output(model: torch.nn.Module) -> torch.Tensor:
    out = model(TOKENS)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


CASES = {
    "xlnet_model": (lambda: xlnet("XLNetModel"), lambda m, layer, dead, _: zero_xlnet_heads(m, layer, dead), 4),
    "xlnet_lm_head": (lambda: xlnet("XLNetLMHeadModel"), lambda m, layer, dead, _: zero_xlnet_heads(m, layer, dead),
                      4),
    "falcon_multi_head": (lambda: falcon(multi_query=False, new_decoder_architecture=False), zero_falcon_heads, 4),
    "falcon_new_decoder": (lambda: falcon(new_decoder_architecture=True, num_kv_heads=2), zero_falcon_heads, 2),
    "falcon_multi_query": (lambda: falcon(multi_query=True, new_decoder_architecture=False), zero_falcon_heads, 4),
}


@pytest.mark.parametrize("name", list(CASES))
def test_heads_made_by_products_with_parameters_remove_as_masking_and_clone_exactly(name: str) -> None:
    """Every layer's heads are one exact group (for Falcon's grouped queries a unit is one key/value head with its
    queries); removing two units of each equals zeroing their output columns and equals zeroing them at the tap."""
    build, zero_columns, count = CASES[name]
    torch.manual_seed(0)
    original: torch.nn.Module = build().double().eval()
    model = copy.deepcopy(original)
    s = Surgeon(model, (TOKENS,))
    heads = [g for g in s.groups if g.kind == "head"]
    assert [(g.count, g.exact) for g in heads] == [(count, True)] * 2, s.explain()
    dead = [0, count - 1] if count > 2 else [count - 1]
    masked = copy.deepcopy(original)

    def zero_dead(a: torch.Tensor) -> None:
        a[..., dead, :] = 0  # (*lead, count, per_unit)
    with torch.no_grad():
        for g in heads:
            zero_columns(masked, g.module, dead, count)
        taps = [s.tap(g, zero_dead) for g in heads]
        by_tap = output(model)
        for tap in taps:
            tap.remove()
        for g in heads:
            s.keep(g, [u for u in range(count) if u not in dead])
        removed = output(model)
        torch.testing.assert_close(removed, output(masked), rtol=0, atol=1e-10)
        torch.testing.assert_close(removed, by_tap, rtol=0, atol=1e-10)
        for g in heads:
            s.clone(g, 0, noise_std=0.1, generator=torch.Generator().manual_seed(0))
        torch.testing.assert_close(output(model), removed, rtol=0, atol=1e-10)


def test_falcon_multi_query_heads_leave_the_one_key_and_value_whole() -> None:
    """Multi-query Falcon views its fused projection's output as the query heads plus the one key and value head
    (``view(..., -1, head_dim)``, then ``split([heads, 1, 1])``): a unit is a query head, its rows of the fused
    weight a segment beside the key's and value's rows, which no group holds and every edit keeps."""
    model = falcon(multi_query=True, new_decoder_architecture=False).eval()
    s = Surgeon(model, (TOKENS,))
    (head, _, _, _) = s.groups
    fused = next(sl for sl in head.slices if sl.name.endswith("query_key_value.weight"))
    assert (fused.dim, fused.start, fused.after, fused.fixed) == (0, 0, 16, 16), fused
    key_value = model.transformer.h[0].self_attention.query_key_value.weight[-16:].clone()
    s.keep(head, [1, 3])
    assert model.transformer.h[0].self_attention.query_key_value.weight.shape == (16 + 16, 32)
    assert torch.equal(model.transformer.h[0].self_attention.query_key_value.weight[-16:], key_value)
    assert model(TOKENS).logits.shape == (2, 9, 100)


def test_falcon_alibi_heads_are_groups() -> None:
    """ALiBi's per-head slopes, computed by the model and handed to each attention, are read there through a gather
    of its kept heads: each attention's heads are a group holding its index buffer, and its MLP is grouped."""
    analysis = fxsurgery.analyse(falcon(alibi=True, multi_query=False, new_decoder_architecture=False).eval(),
                                 (TOKENS,))
    assert sorted(g.kind for g in analysis.groups) == ["channel", "channel", "head", "head"]
    for g in (g for g in analysis.groups if g.kind == "head"):
        assert f"{g.module}.unit_index_0" in {sl.name for sl in g.slices}


def test_a_position_table_read_through_heads_is_no_linear_map() -> None:
    """XLNet's segment embedding (``einsum("ibnd,snd->ibns", q, seg_embed)``) multiplies every head by its own rows
    of a parameter: the query's heads are kept apart, so it starts no space and its rows go with the heads."""
    analysis = fxsurgery.analyse(xlnet("XLNetModel").eval(), (TOKENS,),
                                 {"token_type_ids": torch.zeros_like(TOKENS)})
    (head, *_) = [g for g in analysis.groups if g.kind == "head"]
    assert ("layer.0.rel_attn.seg_embed", 1) in {(sl.name, sl.dim) for sl in head.slices}, head.slices



def test_xlnet_generate_is_served_with_and_without_cache_after_removal_and_clone() -> None:
    """XLNet's ``generate`` passes masks shaped (qlen, klen, batch, 1) and a two-stream query: the graph captured
    for that call holds the key length at one size (``torch.arange(klen)``), so each key length is a call of its
    own. Greedy generation, cached and not, equals the dense model's, then a copy's with the removed heads' output
    columns zeroed, and is unchanged by a clone."""
    torch.manual_seed(0)
    original = xlnet("XLNetLMHeadModel").eval()  # float: XLNet's two-stream path reads its float positions as is
    model = copy.deepcopy(original)
    s = Surgeon(model, (TOKENS,))
    heads = [g for g in s.groups if g.kind == "head"]

    def generated(m: torch.nn.Module) -> list[torch.Tensor]:
        return [m.generate(TOKENS, max_new_tokens=3, do_sample=False, use_cache=cached) for cached in (False, True)]
    with torch.no_grad():
        for got, want in zip(generated(model), generated(original)):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        for g in heads:
            zero_xlnet_heads(original, g.module, [3])
            s.keep(g, [0, 1, 2])
        removed = generated(model)
        for got, want in zip(removed, generated(original)):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        for g in heads:
            s.clone(g, 0, noise_std=0.1, generator=torch.Generator().manual_seed(0))
        for got, want in zip(generated(model), removed):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_falcon_grouped_queries_emptied_layer_generates_with_cache_as_masked() -> None:
    """Analysed on an uncached call (as the Trainer's batches are), a layer may be emptied. A cached call passes an
    object, so the attention's own forward serves it; its code cannot run a layer left with no key/value heads
    (``view(..., 0, -1, head_dim)``), so for the call the layer holds one unit whose tensors are zero, which adds
    nothing, as a removal does. Greedy generation with the cache equals it without, and equals the dense model's
    with that layer's output columns zeroed."""
    torch.manual_seed(0)
    original = falcon(new_decoder_architecture=True, num_kv_heads=2).double().eval()
    model = copy.deepcopy(original)
    s = Surgeon(model, (TOKENS,), {"use_cache": False})
    (first, *_) = [g for g in s.groups if g.kind == "head"]
    assert first.min_count == 0
    options = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        s.keep(first, [])
        zero_falcon_heads(original, first.module, [0, 1], 2)
        cached = model.generate(TOKENS, use_cache=True, **options)
        torch.testing.assert_close(cached, model.generate(TOKENS, use_cache=False, **options), rtol=0, atol=0)
        torch.testing.assert_close(cached, original.generate(TOKENS, use_cache=True, **options), rtol=0, atol=0)
        assert model.transformer.h[0].self_attention.num_kv_heads == 2  # set for each call, its own value after it
