"""fxsurgery on patterns beyond the conformance lists: inferred head sizes, layers of one unit,
parameters shared by every block, fused parallel blocks."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from zoo import train_steps

from fxsurgery import Surgeon


class MinusOneAttention(nn.Module):
    """Fused q/k/v split into heads with ``view(b, n, heads, -1)``: the head size is inferred."""

    def __init__(self, dim: int = 12, heads: int = 3):
        super().__init__()
        self.h = heads
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q, k, v = (t.view(b, n, self.h, -1).transpose(1, 2) for t in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v)
        return self.out(o.transpose(1, 2).reshape(b, n, -1))


def test_view_with_minus_one_reaches_zero_heads_and_trains() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 12), MinusOneAttention(), nn.LayerNorm(12), nn.Linear(12, 3))
    x = torch.randn(2, 4, 5)
    s = Surgeon(model, (x,))
    head = next(g for g in s.groups if g.kind == "head")
    assert (head.count, head.min_count) == (3, 0) and not head.notes
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    s.attach_optimizer(opt)
    train_steps(model, opt, x)
    while head.count:
        s.remove(head, 0)
    assert model[1].qkv.weight.shape[0] == 0
    assert torch.isfinite(train_steps(model, opt, x))
    assert model(torch.randn(3, 7, 5)).shape == (3, 7, 3)  # other batch and token counts still run
