"""Multi-query attention: one key/value head that every query head reads (broadcast, grouped-query attention with
one group, or repeated to the query heads by expand + reshape). Each query head is a unit; the key and value
projections are shared and stay whole."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from zoo import masked_copy

from fxsurgery import Surgeon, UnitGroup


class MultiQueryAttention(nn.Module):
    def __init__(self, dim: int = 8, heads: int = 3, head_dim: int = 4, gqa: bool = False):
        super().__init__()
        self.heads, self.head_dim, self.gqa = heads, head_dim, gqa
        self.q, self.out = nn.Linear(dim, heads * head_dim), nn.Linear(heads * head_dim, dim)
        self.k, self.v = nn.Linear(dim, head_dim), nn.Linear(dim, head_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q = self.q(x).view(b, n, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.k(x).unsqueeze(1), self.v(x).unsqueeze(1)  # [b, 1, n, head_dim]
        o = F.scaled_dot_product_attention(q, k, v, enable_gqa=self.gqa)
        return self.out(o.transpose(1, 2).reshape(b, n, -1))


class Model(nn.Module):
    def __init__(self, gqa: bool):
        super().__init__()
        self.embed, self.attn, self.head = nn.Linear(3, 8), MultiQueryAttention(gqa=gqa), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        return self.head(h + self.attn(h))


@pytest.mark.parametrize("gqa", [False, True])
def test_query_heads_are_units_and_key_value_stay(gqa: bool) -> None:
    torch.manual_seed(0)
    model, x = Model(gqa).double(), torch.randn(2, 5, 3, dtype=torch.double)
    masked, cloned = copy.deepcopy(model), copy.deepcopy(model)
    s = Surgeon(model, (x,))
    (heads,) = [g for g in s.groups if g.kind == "head"]
    assert (heads.module, heads.count, heads.exact) == ("attn", 3, True)
    assert {sl.name.split(".")[1] for sl in heads.slices} == {"q", "out"}  # k and v are not sliced
    with torch.no_grad():
        s.remove(heads, 0)
        masked.attn.out.weight[:, :4] = 0
        assert (model(x) - masked(x)).abs().max() <= 1e-9
        assert model.attn.k.weight.shape == (4, 8) and model.attn.q.weight.shape == (8, 8)
        y0 = cloned(x)
    sc = Surgeon(cloned, (x,))
    sc.clone(sc.group(heads.name), 1, noise_std=0.1)
    with torch.no_grad():
        assert (cloned(x) - y0).abs().max() <= 1e-9


class RepeatedKeyValueAttention(nn.Module):
    """Query heads sharing ``kv_heads`` key/value heads, each repeated ``heads // kv_heads`` times by an expand and a
    reshape before the attention (transformers' ``repeat_kv``), which runs by ``F.scaled_dot_product_attention`` or
    by matmuls (the eager path)."""

    def __init__(self, *, heads: int, kv_heads: int, eager: bool, dim: int = 8, head_dim: int = 3):
        super().__init__()
        self.heads, self.head_dim, self.eager = heads, head_dim, eager
        self.n_rep = heads // kv_heads
        self.q, self.out = nn.Linear(dim, heads * head_dim), nn.Linear(heads * head_dim, dim)
        self.k, self.v = nn.Linear(dim, kv_heads * head_dim), nn.Linear(dim, kv_heads * head_dim)

    def repeat(self, t: torch.Tensor) -> torch.Tensor:
        b, kv_heads, n, d = t.shape
        return t[:, :, None, :, :].expand(b, kv_heads, self.n_rep, n, d).reshape(b, kv_heads * self.n_rep, n, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = (proj(x).view(b, n, -1, self.head_dim).transpose(1, 2) for proj in (self.q, self.k, self.v))
        k, v = self.repeat(k), self.repeat(v)
        if self.eager:
            weights = torch.softmax(q @ k.transpose(2, 3) * self.head_dim ** -0.5, dim=-1)
            o = weights @ v
        else:
            o = F.scaled_dot_product_attention(q, k, v)
        return self.out(o.transpose(1, 2).reshape(b, n, -1))


class RepeatedModel(nn.Module):
    def __init__(self, **attention):
        super().__init__()
        self.embed, self.attn, self.head = nn.Linear(3, 8), RepeatedKeyValueAttention(**attention), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        return self.head(h + self.attn(h))


def zeroed_by_tap_then_kept(s: Surgeon, group: UnitGroup, model: nn.Module, x: torch.Tensor, *, kept: list[int],
                            dead: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The outputs with the ``dead`` units' activations zeroed through the tap, then with the Surgeon keeping only
    ``kept`` (the two sides of removal equals masking)."""
    def zero_dead(a: torch.Tensor) -> None:
        a[..., dead, :] = 0
    with torch.no_grad():
        tap = s.tap(group, zero_dead)
        by_tap = model(x)
        tap.remove()
        s.keep(group, kept)
        return by_tap, model(x)


@settings(max_examples=12, deadline=None)
@given(kv_heads=st.sampled_from([1, 2]), n_rep=st.sampled_from([2, 3]), eager=st.booleans(), data=st.data())
def test_repeated_key_value_heads_follow_the_query_heads(kv_heads: int, n_rep: int, eager: bool,
                                                         data: st.DataObject) -> None:
    """Key/value heads repeated to the query heads by expand + reshape: with one key/value head (multi-query) each
    query head is a unit and the repeat's size follows their count (the expand and the reshape read no coordinate of
    the heads: they are found by following the repeated operand back from the attention); with several, a unit is
    one key/value head with its query heads. Keeping any units equals zeroing the others through the tap and
    zeroing their output columns on a copy of the dense model; a clone leaves the outputs unchanged."""
    heads = kv_heads * n_rep
    torch.manual_seed(0)
    original = RepeatedModel(heads=heads, kv_heads=kv_heads, eager=eager).double()
    x = torch.randn(2, 5, 3, dtype=torch.double)
    model = copy.deepcopy(original)
    s = Surgeon(model, (x,))
    (group,) = [g for g in s.groups if g.kind == "head"]
    count = heads if kv_heads == 1 else kv_heads
    width = 3 * heads // count  # output columns per unit
    assert (group.count, group.exact) == (count, True)
    assert ({"k", "v"} & {sl.name.split(".")[1] for sl in group.slices}) == (set() if kv_heads == 1 else {"k", "v"})
    kept = data.draw(st.lists(st.integers(0, count - 1), min_size=1, max_size=count, unique=True).map(sorted))
    dead = set(range(count)) - set(kept)
    by_tap, removed = zeroed_by_tap_then_kept(s, group, model, x, kept=kept, dead=sorted(dead))
    with torch.no_grad():
        assert (removed - by_tap).abs().max() <= 1e-9
        assert (removed - masked_copy(original, {"attn.out.weight": dead}, {"attn.out.weight": width})(x)).abs().max() \
            <= 1e-9
        s.clone(group, 0, noise_std=0.1, generator=torch.Generator().manual_seed(0))
        assert (model(x) - removed).abs().max() <= 1e-9


class FusedMultiQueryAttention(nn.Module):
    """Queries and the one key/value head from one projection (GPTBigCode's c_attn): [q heads | k | v] rows."""

    def __init__(self, dim: int = 8, heads: int = 2):
        super().__init__()
        self.dim, self.head_dim = dim, dim // heads
        self.c_attn, self.out = nn.Linear(dim, dim + 2 * self.head_dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = self.c_attn(x).split((self.dim, self.head_dim, self.head_dim), dim=2)
        q = q.view(b, n, -1, self.head_dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k.unsqueeze(1), v.unsqueeze(1), is_causal=True)
        return self.out(o.transpose(1, 2).reshape(b, n, -1))


class FusedModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn, self.fc1, self.fc2 = FusedMultiQueryAttention(), nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x)
        return x + self.fc2(F.gelu(self.fc1(x)))


@pytest.mark.parametrize("kept", [[1], [0, 1], []])
def test_query_heads_fused_beside_one_key_value_head_remove_as_masking(kept: list[int]) -> None:
    """The shared key/value rows are no unit axis; the query heads beside them fill a segment of the fused weight,
    whose other rows no group holds: they stay through every edit. Keeping any heads (none too) equals zeroing the
    others through the tap and zeroing their output columns on a copy of the dense model; a clone leaves the outputs
    unchanged."""
    torch.manual_seed(0)
    original, x = FusedModel().double(), torch.randn(2, 5, 8, dtype=torch.double)
    model = copy.deepcopy(original)
    s = Surgeon(model, (x,))
    (group,) = [g for g in s.groups if g.kind == "head"]
    assert (group.module, group.count, group.exact) == ("attn", 2, True)
    dead = sorted({0, 1} - set(kept))
    key_value = model.attn.c_attn.weight[8:].clone()
    by_tap, removed = zeroed_by_tap_then_kept(s, group, model, x, kept=kept, dead=dead)
    with torch.no_grad():
        assert model.attn.c_attn.weight.shape == (4 * len(kept) + 8, 8)
        assert torch.equal(model.attn.c_attn.weight[-8:], key_value)
        assert (removed - by_tap).abs().max() <= 1e-9
        assert (removed - masked_copy(original, {"attn.out.weight": set(dead)}, {"attn.out.weight": 4})(x)).abs() \
            .max() <= 1e-9
        if kept:
            s.clone(group, 0, noise_std=0.1, generator=torch.Generator().manual_seed(0))
            assert (model(x) - removed).abs().max() <= 1e-9
