"""The memo of meta runs: the same shapes, strides and dtypes as a plain meta run, each new-tensor op's kernel run
once per metadata of its arguments (and default dtype) in the process, and views, in-place ops and real data left to
run as they are."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fxsurgery.capture import meta_memo
from fxsurgery.capture.meta_memo import MetaMemo


@pytest.fixture(autouse=True)
def empty_table():
    """Each test starts from an empty process-wide table."""
    meta_memo.LAYOUTS.clear()


class Block(nn.Module):
    def __init__(self, d: int = 8):
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(d), nn.Linear(d, 2 * d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.fc(self.norm(x)).chunk(2, dim=-1)
        return x + F.gelu(a) * b.softmax(-1).transpose(1, 2).transpose(1, 2)


def layout(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.stride(), t.storage_offset(), t.dtype


def test_a_memoised_meta_run_gives_the_plain_run_s_layouts():
    model = nn.Sequential(Block(), Block(), Block()).to("meta")
    for x in (torch.empty(2, 5, 8, device="meta"), torch.empty(2, 5, 8, device="meta", dtype=torch.float64),
              torch.empty(5, 2, 8, device="meta").transpose(0, 1)):
        plain = [layout(model[:k](x)) for k in range(1, 4)]
        with MetaMemo() as memo:
            memoised = [layout(model[:k](x)) for k in range(1, 4)]
        assert memoised == plain
        assert memo.known  # the blocks' kernels ran once per layout


def test_hits_skip_the_kernel_and_give_new_tensors():
    x = torch.empty(3, 4, device="meta")
    with MetaMemo() as memo:
        first = torch.exp(x)
        calls = len(memo.known)
        second = torch.exp(x)
    assert len(memo.known) == calls and layout(first) == layout(second) and first is not second


def test_views_in_place_ops_and_real_tensors_run_as_they_are():
    x = torch.empty(3, 4, device="meta")
    with MetaMemo() as memo:
        v = x.view(12)
        x.add_(1)
        real = torch.ones(2) * 3
    assert v._base is x
    assert torch.equal(real, torch.full((2,), 3.0))
    assert not memo.known


def test_scalars_of_another_type_promote_apart():
    x = torch.empty(3, dtype=torch.int64, device="meta")
    with MetaMemo():
        assert (x * 2).dtype == torch.int64
        assert (x * 2.0).dtype == torch.float32


def test_a_later_memo_reuses_what_an_earlier_one_worked_out():
    x = torch.empty(3, 4, device="meta")
    with MetaMemo() as first:
        torch.exp(x)
    known = len(first.known)
    with MetaMemo() as second:  # another run: a later analysis of a model built alike
        assert layout(torch.exp(x)) == layout(torch.empty(3, 4))
    assert second.known is first.known and len(second.known) == known > 0


def test_the_default_dtype_is_part_of_the_key():
    x = torch.empty(3, dtype=torch.int64, device="meta")
    default = torch.get_default_dtype()
    with MetaMemo():
        assert (x * 2.0).dtype == torch.float32 and torch.arange(3.0, device="meta").dtype == torch.float32
        torch.set_default_dtype(torch.float64)
        try:
            assert (x * 2.0).dtype == torch.float64 and torch.arange(3.0, device="meta").dtype == torch.float64
        finally:
            torch.set_default_dtype(default)


def test_the_table_is_emptied_at_its_bound(monkeypatch):
    monkeypatch.setattr(meta_memo, "MAX_LAYOUTS", 2)
    x = torch.empty(3, 4, device="meta")
    with MetaMemo() as memo:
        torch.exp(x)
        torch.sin(x)
        assert len(memo.known) == 2
        assert layout(torch.cos(x)) == layout(torch.empty(3, 4))
        assert len(memo.known) == 1
