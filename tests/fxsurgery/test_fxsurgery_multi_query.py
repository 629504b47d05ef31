"""Multi-query attention: one key/value head that every query head reads (broadcast, or grouped-query attention
with one group). Each query head is a unit; the key and value projections are shared and stay whole."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fxsurgery import Surgeon


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
