"""Attention with rotary position embeddings on q and k: the rotation acts within each head's dims, alike for
every head, so heads stay separable units. The tokens that skip the rotation (prefix tokens, none or a class
token) are concatenated back, an empty slice included. A partial rotation written in place (``q[..., :r] = ...``)
keeps the heads apart too."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from test_fxsurgery_head_patterns import assert_head_oracles

from fxsurgery import Surgeon


def rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """[x0 x1 x2 x3] -> [-x1 x0 -x3 x2]."""
    return torch.stack([-x[..., 1::2], x[..., ::2]], -1).reshape(x.shape)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[x0 x1 x2 x3] -> [-x2 -x3 x0 x1]."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


class RopeAttention(nn.Module):
    """Fused q/k/v; sin and cos tables (one row per rotated token) applied to q and k after the prefix."""

    def __init__(self, dim: int = 8, heads: int = 3, head_dim: int = 4, prefix: int = 0, half: bool = False):
        super().__init__()
        self.heads, self.head_dim, self.prefix, self.half = heads, head_dim, prefix, half
        self.qkv, self.proj = nn.Linear(dim, 3 * heads * head_dim), nn.Linear(heads * head_dim, dim)

    def rope(self, x: torch.Tensor, sin: torch.Tensor, cos: torch.Tensor) -> torch.Tensor:
        rotated = (rotate_half if self.half else rotate_pairs)(x)
        return x * cos + rotated * sin

    def forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        sin, cos = table.chunk(2, dim=-1)
        p = self.prefix
        q = torch.cat([q[:, :, :p], self.rope(q[:, :, p:], sin, cos)], dim=2)
        k = torch.cat([k[:, :, :p], self.rope(k[:, :, p:], sin, cos)], dim=2)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(b, n, -1))


class RopeModel(nn.Module):
    def __init__(self, prefix: int, half: bool, tokens: int = 5, head_dim: int = 4):
        super().__init__()
        self.embed, self.attn, self.head = nn.Linear(3, 8), RopeAttention(prefix=prefix, half=half), nn.Linear(8, 2)
        angles = torch.arange(tokens - prefix)[:, None] * torch.linspace(0.1, 1.0, head_dim)
        self.register_buffer("table", torch.cat([angles.sin(), angles.cos()], dim=-1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        return self.head(h + self.attn(h, self.table))


@pytest.mark.parametrize("prefix", [0, 1])
@pytest.mark.parametrize("half", [False, True])
def test_rotary_heads_are_one_exact_group(prefix: int, half: bool) -> None:
    torch.manual_seed(0)
    model, x = RopeModel(prefix, half).double(), torch.randn(2, 5, 3, dtype=torch.double)
    masked, cloned = copy.deepcopy(model), copy.deepcopy(model)
    s = Surgeon(model, (x,))
    (heads,) = [g for g in s.groups if g.kind == "head"]
    assert (heads.module, heads.count, heads.exact) == ("attn", 3, True)
    assert not [lo for lo in s.left_out if lo.module.startswith("attn")]
    with torch.no_grad():
        s.remove(heads, 1)
        masked.attn.proj.weight[:, 4:8] = 0  # head 1's dims of the output projection
        assert (model(x) - masked(x)).abs().max() <= 1e-9
        y0 = cloned(x)
    sc = Surgeon(cloned, (x,))
    sc.clone(sc.group(heads.name), 2, noise_std=0.1)
    with torch.no_grad():
        assert cloned.attn.qkv.weight.shape[0] == 48 and (cloned(x) - y0).abs().max() <= 1e-9


class PartialRopeModel(nn.Module):
    """Rotary on the first ``rotated`` dims of each head, written in place after an Ellipsis (``q[..., :r] = ...``):
    the written region spans every head, at dims the Ellipsis skips."""

    def __init__(self, heads: int = 3, head_dim: int = 4, rotated: int = 2, tokens: int = 5):
        super().__init__()
        self.heads, self.head_dim, self.rotated = heads, head_dim, rotated
        self.embed, self.head = nn.Linear(3, 8), nn.Linear(8, 2)
        self.qkv, self.proj = nn.Linear(8, 3 * heads * head_dim), nn.Linear(heads * head_dim, 8)
        self.register_buffer("angle", torch.linspace(0, 1, tokens)[:, None].repeat(1, rotated))

    def rope(self, x: torch.Tensor) -> torch.Tensor:
        x = x.clone()
        r = self.rotated
        x[..., :r] = x[..., :r] * self.angle.cos() + x[..., :r].flip(-1) * self.angle.sin()
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        b, n, _ = h.shape
        q, k, v = self.qkv(h).reshape(b, n, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        out = F.scaled_dot_product_attention(self.rope(q), self.rope(k), v)
        return self.head(h + self.proj(out.transpose(1, 2).reshape(b, n, -1)))


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_partial_rotary_written_in_place_keeps_exact_heads(mode: str) -> None:
    torch.manual_seed(0)
    original, x = PartialRopeModel().double(), torch.randn(2, 5, 3, dtype=torch.double)
    model = copy.deepcopy(original)
    s = Surgeon(model, (x,))
    (heads,) = [g for g in s.groups if g.kind == "head"]
    assert (heads.count, heads.exact) == (3, True)
    assert_head_oracles(original, model, s, x, out_weight="proj.weight", head_dim=4, mode=mode)


class OwnTableRopeAttention(RopeAttention):
    """Rotary attention that computes its table from an inverse-frequency buffer of its own (Llama's form, inside
    the layer): the table has no head dim at all, and every head reads it alike."""

    def __init__(self, heads: int, head_dim: int = 4):
        super().__init__(heads=heads, head_dim=head_dim, half=True)
        inverse = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        self.register_buffer("inv_freq", inverse, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        freqs = torch.arange(x.shape[1], dtype=x.dtype)[:, None] * self.inv_freq[None]
        angles = torch.cat([freqs, freqs], dim=-1)
        return super().forward(x, torch.cat([angles.sin(), angles.cos()], dim=-1))


class OneHeadRopeModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Linear(3, 8), nn.Linear(8, 2)
        self.blocks = nn.ModuleList(OwnTableRopeAttention(heads=1) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def test_one_head_layers_reading_their_own_rotary_table_are_exact_groups() -> None:
    """A layer of one head whose rotary table comes from its own inverse frequencies (a tensor with no size-1 dim,
    which the widened head broadcasts over) is a group of its own: its head removed equals its output-projection
    columns zeroed and equals zeroing the head at its tap; a clone keeps the outputs; the cloned pair's second
    head removed equals its columns zeroed (before: refused, the frequencies taken for a tensor of the head)."""
    from tests.zoo import assert_removal_masks_and_clone_keeps

    torch.manual_seed(0)
    model, x = OneHeadRopeModel().double(), torch.randn(2, 5, 3, dtype=torch.double)
    masked = copy.deepcopy(model)
    with torch.no_grad():
        masked.blocks[1].proj.weight.zero_()
    s = Surgeon(model, (x,))
    assert sorted((g.name, g.count, g.exact) for g in s.groups if g.kind == "head") == [
        ("blocks.0:head", 1, True), ("blocks.1:head", 1, True)], s.explain()
    second = s.group("blocks.1:head")
    with torch.no_grad():
        handle = s.tap(second, lambda heads: heads.zero_())
        by_tap = model(x)
        handle.remove()
        s.remove(second, 0)
        assert second.count == 0 and model.blocks[1].qkv.weight.shape[0] == 0
        assert (model(x) - masked(x)).abs().max() <= 1e-9 and (model(x) - by_tap).abs().max() <= 1e-9
    first = s.group("blocks.0:head")
    with torch.no_grad():
        before = model(x)
        s.clone(first, 0, noise_std=0.1)
        assert first.count == 2 and (model(x) - before).abs().max() <= 1e-9
        by_weights = copy.deepcopy(model)
        by_weights.blocks[0].proj.weight[:, 4:8] = 0
        expected = by_weights(x)
    assert_removal_masks_and_clone_keeps(s, first, 1, lambda: model(x), by_weights=expected, reference=before)


def test_one_head_layers_of_a_model_sharing_its_rotary_table_and_mask_are_a_group_each() -> None:
    """Llama with one head per layer: the model computes the rotary table and the causal mask once and hands them to
    every layer; with one head, each frequency meets one coordinate of a layer's head and each mask element the
    head's scores, which read alone cannot tell a table every head reads alike from one of the head. A table met
    along a head's coordinates and a mask broadcast beside it tie no layers together (before: one group refused at
    ``model.layers``), so each layer's head is a group: removing the second layer's head equals zeroing its
    ``o_proj`` and equals zeroing it at its tap, and decoding from the cache then equals that masked model; a clone
    of the first layer's head keeps the logits and its copy removed equals its columns zeroed."""
    transformers = pytest.importorskip("transformers")
    from tests.fxsurgery.test_fxsurgery_fused_qkv_pieces import assert_decodes_as_masked
    from tests.zoo import assert_removal_masks_and_clone_keeps

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                                      num_attention_heads=1, num_key_value_heads=1, max_position_embeddings=32)
    model = transformers.LlamaForCausalLM(config).double().eval()
    ids = torch.randint(3, 64, (2, 5), generator=torch.Generator().manual_seed(0))
    masked = copy.deepcopy(model)
    with torch.no_grad():
        masked.model.layers[1].self_attn.o_proj.weight.zero_()
    s = Surgeon(model, (), {"input_ids": ids})
    assert sorted((g.name, g.count, g.exact) for g in s.groups if g.kind == "head") == [
        (f"model.layers.{i}.self_attn:head", 1, True) for i in range(2)], s.explain()
    second = s.group("model.layers.1.self_attn:head")
    with torch.no_grad():
        handle = s.tap(second, lambda heads: heads.zero_())
        by_tap = model(ids).logits
        handle.remove()
        s.remove(second, 0)
        assert (model(ids).logits - masked(ids).logits).abs().max() <= 1e-10
        assert (model(ids).logits - by_tap).abs().max() <= 1e-10
    more = torch.randint(3, 64, (2, 2), generator=torch.Generator().manual_seed(1))
    assert_decodes_as_masked(model, masked, ids, more)
    first = s.group("model.layers.0.self_attn:head")
    with torch.no_grad():
        before = model(ids).logits
        s.clone(first, 0, noise_std=0.1)
        assert first.count == 2 and (model(ids).logits - before).abs().max() <= 1e-10
        by_weights = copy.deepcopy(model)
        by_weights.model.layers[0].self_attn.o_proj.weight[:, 16:] = 0
        expected = by_weights(ids).logits
    assert_removal_masks_and_clone_keeps(s, first, 1, lambda: model(ids).logits, by_weights=expected,
                                         reference=before)
