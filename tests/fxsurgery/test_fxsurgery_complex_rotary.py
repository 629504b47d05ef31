"""Rotary positions applied in complex form (Llama 4's): q and k viewed as complex pairs (``view_as_complex`` of a
last dim of 2), multiplied by one complex rotation per position, viewed back (``view_as_real``) and flattened. A
pair rotates within its head, alike for every head: heads stay exact units, under the symbolic trace and under
torch.export (a shape unpacked at run time, ``x.reshape(*x.shape[:-1], -1, 2)``, which the trace cannot follow).
Removal of a head equals zeroing its columns of the output projection and equals zeroing it at its tap; a clone
leaves the outputs unchanged. With one head, whose axis only widening finds, the reshape into pairs infers the
size beside it (``reshape(b, n, 1, -1, 2)``): the head stays on its size-1 dim, not in the ``-1``."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from fxsurgery import Surgeon, UnitGroup

DIM, HEADS, HEAD_DIM, TOKENS = 16, 4, 6, 5


class ComplexRotaryAttention(nn.Module):
    """q/k/v maps; q and k rotated as complex pairs by a buffer of one rotation per position (not per head)."""

    def __init__(self, unpacked_shape: bool, heads: int):
        super().__init__()
        self.unpacked_shape, self.heads = unpacked_shape, heads
        self.q, self.k, self.v = (nn.Linear(DIM, heads * HEAD_DIM) for _ in range(3))
        self.out = nn.Linear(heads * HEAD_DIM, DIM)
        angles = torch.arange(TOKENS)[:, None] * torch.linspace(0.1, 1.0, HEAD_DIM // 2)
        self.register_buffer("rotations", torch.polar(torch.ones_like(angles), angles).to(torch.complex128))

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (batch, tokens, heads, head_dim) with each pair of its last dim rotated by its token's angle."""
        pairs_shape = (*x.shape[:-1], -1, 2) if self.unpacked_shape else (x.shape[0], TOKENS, self.heads, -1, 2)
        pairs = torch.view_as_complex(x.reshape(pairs_shape))
        return torch.view_as_real(pairs * self.rotations[:, None, :]).flatten(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = (proj(x).view(b, n, self.heads, HEAD_DIM) for proj in (self.q, self.k, self.v))
        q, k, v = (t.transpose(1, 2) for t in (self.rotate(q), self.rotate(k), v))
        weights = (q @ k.transpose(-1, -2) / HEAD_DIM ** 0.5).softmax(-1)
        return self.out((weights @ v).transpose(1, 2).reshape(b, n, -1))


class ComplexRotaryModel(nn.Module):
    def __init__(self, unpacked_shape: bool, heads: int = HEADS):
        super().__init__()
        self.embed, self.head = nn.Linear(3, DIM), nn.Linear(DIM, 2)
        self.attn = ComplexRotaryAttention(unpacked_shape, heads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        return self.head(h + self.attn(h))


def heads_of(s: Surgeon, count: int = HEADS) -> UnitGroup:
    (heads,) = [g for g in s.groups if g.kind == "head"]
    assert (heads.module, heads.count, heads.exact) == ("attn", count, True), s.explain()
    return heads


def assert_head_removal_equals_masking(model: nn.Module, s: Surgeon, heads: UnitGroup, x: torch.Tensor,
                                       unit: int) -> None:
    """Removing ``unit`` of ``heads`` equals zeroing it at its tap and zeroing its columns of the output projection
    (on a copy), and changes the outputs."""
    with torch.no_grad():
        reference = model(x)
        handle = s.tap(heads, lambda a: a.select(-2, unit).zero_())
        by_tap = model(x)
        handle.remove()
        masked = copy.deepcopy(model)
        masked.get_parameter("attn.out.weight")[:, unit * HEAD_DIM:(unit + 1) * HEAD_DIM] = 0
        by_weights = masked(x)
        count = heads.count
        s.remove(heads, unit)
        removed = model(x)
    assert heads.count == count - 1
    assert (removed - by_weights).abs().max() < 1e-10 and (removed - by_tap).abs().max() < 1e-10
    assert (removed - reference).abs().max() > 1e-6


@pytest.mark.parametrize("unpacked_shape", [False, True])
def test_complex_rotary_heads_removal_equals_masking_and_clone_keeps_outputs(unpacked_shape: bool) -> None:
    torch.manual_seed(0)
    original = ComplexRotaryModel(unpacked_shape).double()
    x = torch.randn(2, TOKENS, 3, dtype=torch.double)
    model = copy.deepcopy(original)
    s = Surgeon(model, (x,))
    heads = heads_of(s)
    assert ("torch.export" in s.explain()) == unpacked_shape  # the front end that captured the attention
    with torch.no_grad():
        assert (model(x) - original(x)).abs().max() < 1e-12
    assert_head_removal_equals_masking(model, s, heads, x, unit=1)
    with torch.no_grad():
        removed = model(x)
        s.clone(heads, 0, noise_std=0.1, generator=torch.Generator().manual_seed(0))
        assert (model(x) - removed).abs().max() < 1e-10


@pytest.mark.parametrize("unpacked_shape", [False, True])
def test_one_complex_rotary_head_is_a_group_that_clones_and_removes_exactly(unpacked_shape: bool) -> None:
    torch.manual_seed(0)
    model, x = ComplexRotaryModel(unpacked_shape, heads=1).double(), torch.randn(2, TOKENS, 3, dtype=torch.double)
    s = Surgeon(model, (x,))
    heads = heads_of(s, count=1)
    with torch.no_grad():
        before = model(x)
        s.clone(heads, 0, noise_std=0.1, generator=torch.Generator().manual_seed(0))
        assert heads.count == 2 and (model(x) - before).abs().max() < 1e-10
    assert_head_removal_equals_masking(model, s, heads, x, unit=0)
