"""A host's own forward serves the calls a graph cannot (here: a forward hook on one of its modules) with the count
attributes it reads set to the current widths. Which attributes those are is fitted on copies of the host with random
parameters. Drawn small, they make attention nearly uniform, and heads split at a wrong size then compute almost what
the right split computes; so a removal is also checked on parameters at unit scale. The block below splits its heads
by ``num_heads`` and takes the head size from the channels: the fit must find ``num_heads``, and the hooked call after
removals must equal the model with those heads masked, by weights and by taps."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from fxsurgery import Surgeon

DIM, HEADS, TOKENS = 16, 4, 6


class Attention(nn.Module):
    """Pre-norm self-attention with a residual; the head size is whatever ``num_heads`` leaves of the channels."""

    def __init__(self):
        super().__init__()
        self.num_heads = HEADS
        self.norm = nn.LayerNorm(DIM)
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, _ = x.shape
        q, k, v = self.qkv(self.norm(x)).reshape(batch, tokens, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        attention = (q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5).softmax(dim=-1)
        return x + self.proj((attention @ v).transpose(1, 2).reshape(batch, tokens, -1))


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Attention() for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def head_columns(head: int) -> slice:
    return slice(head * DIM // HEADS, (head + 1) * DIM // HEADS)


@pytest.mark.parametrize("removed", [[1], [0, 2], [3, 1, 2]])
def test_a_hooked_call_after_removals_equals_masking_when_heads_split_by_an_attribute(removed: list[int]) -> None:
    torch.manual_seed(0)
    model = Stack().double().eval()
    with torch.no_grad():  # trained weights: attention far from uniform
        for block in model.blocks:
            block.qkv.weight.mul_(4.0)
    x = torch.randn(2, TOKENS, DIM, dtype=torch.float64)
    by_weights = copy.deepcopy(model)
    with torch.no_grad():
        for head in removed:
            by_weights.blocks[0].proj.weight[:, head_columns(head)] = 0
        masked = by_weights(x)
    s = Surgeon(model, (x,))
    heads = s.group("blocks.0:head")
    assert heads.count == HEADS and heads.exact, s.explain()
    handle = s.tap(heads, lambda a: a.index_fill_(-2, torch.tensor(removed), 0))
    with torch.no_grad():
        by_taps = model(x)
    handle.remove()
    assert (by_taps - masked).abs().max() < 1e-10
    for head in sorted(removed, reverse=True):
        s.remove(heads, head)
    seen = []
    hook = model.blocks[0].qkv.register_forward_hook(lambda module, args, out: seen.append(out.shape[-1]))
    with torch.no_grad():
        hooked = model(x)
    hook.remove()
    assert seen == [3 * (DIM - len(removed) * DIM // HEADS)]  # the hook ran, on the compact layer
    assert model.blocks[0].num_heads == HEADS  # set for the call only
    assert (hooked - masked).abs().max() < 1e-10
    with torch.no_grad():
        assert (model(x) - masked).abs().max() < 1e-10
