"""fxsurgery on patterns beyond the conformance lists: inferred head sizes, layers of one unit,
parameters shared by every block, fused parallel blocks."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from zoo import Style, TinyTransformer, train_steps

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


def test_one_channel_ffn_is_a_group_that_receives() -> None:
    torch.manual_seed(0)
    model = TinyTransformer(Style(mlp_hidden=1, depth=2)).double()
    x = torch.randn(3, 6, 5, dtype=torch.double)
    s = Surgeon(model, (x,))
    ffn = [g for g in s.groups if g.kind == "channel"]
    assert [(g.module, g.count, g.min_count) for g in ffn] == [("blocks.0.mlp", 1, 1), ("blocks.1.mlp", 1, 1)]
    with torch.no_grad():
        y0 = model(x)
    for g in ffn:
        s.clone(g, 0, noise_std=0.1)
    with torch.no_grad():
        assert (model(x) - y0).abs().max() <= 1e-9
    assert model.blocks[0].mlp.fc1.weight.shape[0] == 2 and model.blocks[0].mlp.fc2.in_features == 2


def test_compact_model_analysed_again_at_one_unit() -> None:
    """A model operated down to one FFN channel and one head, then wrapped again: the channel is a
    group that can receive; the single head is reported at its module, not silently dropped."""
    torch.manual_seed(0)
    model = TinyTransformer(Style(heads=3, mlp_hidden=4, depth=1)).double()
    x = torch.randn(3, 6, 5, dtype=torch.double)
    s = Surgeon(model, (x,))
    for g in s.groups:
        s.keep(g, [1])
    again = Surgeon(model, (x,))
    ffn = again.group("blocks.0.mlp:channel")
    assert ffn.count == 1
    assert [lo.module for lo in again.left_out if any("single unit" in r for r in lo.reasons)] == ["blocks.0.attn"]
    with torch.no_grad():
        y0 = model(x)
    again.clone(ffn, 0, noise_std=0.1)
    with torch.no_grad():
        assert (model(x) - y0).abs().max() <= 1e-9
