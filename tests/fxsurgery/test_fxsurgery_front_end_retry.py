"""Where the symbolic trace leaves units out, the concrete-shape capture is tried too, and serves if it finds more
groups. It is tried in train mode first: the groups found in both modes are some of those, so where it finds no more
there, eval mode is not captured (a whole model's capture takes long); where it does, each mode is captured once."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fxsurgery import analyse
from fxsurgery.analysis import host
from fxsurgery.capture.front_ends import FrontEnd

HIDDEN, HEADS, FFN = 16, 4, 24


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """A helper the symbolic trace keeps as a call (it branches on a size, so it is not inlined, and no rule reads
    it); torch.export looks into it."""
    return F.scaled_dot_product_attention(q, k, v) if q.shape[-2] > 0 else v


torch.fx.wrap("attend")


class Attention(nn.Module):
    """``helper``: the attention is computed by ``attend``; ``position``: a depthwise convolution of the values over
    the tokens is added (a head owns its channels of it)."""

    def __init__(self, *, helper: bool, position: nn.Conv1d | None, of_input: bool = False):
        super().__init__()
        self.qkv, self.proj = nn.Linear(HIDDEN, 3 * HIDDEN), nn.Linear(HIDDEN, HIDDEN)
        self.helper, self.position, self.of_input = helper, position, of_input

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, HEADS, c // HEADS).permute(2, 0, 3, 1, 4).unbind(0)
        out = attend(q, k, v) if self.helper else F.scaled_dot_product_attention(q, k, v)
        if self.position is not None:
            convolved = x.transpose(1, 2) if self.of_input else v.transpose(-1, -2).reshape(b, c, n)
            out = out + self.position(convolved).reshape(b, HEADS, -1, n).transpose(-1, -2)
        return self.proj(out.transpose(1, 2).reshape(b, n, c))


class Blocks(nn.Module):
    """Two attention layers and an FFN; ``shared``: the layers call one position convolution, the first on its values
    and the second on its input, which ties the first layer's heads to the stream."""

    def __init__(self, *, helper: bool, shared: bool):
        super().__init__()
        position = nn.Conv1d(HIDDEN, HIDDEN, 3, padding=1, groups=HIDDEN) if shared else None
        self.attns = nn.ModuleList(Attention(helper=helper, position=position, of_input=i == 1) for i in range(2))
        self.fc1, self.fc2 = nn.Linear(HIDDEN, FFN), nn.Linear(FFN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for attn in self.attns:
            x = x + attn(x)
        return x + self.fc2(F.gelu(self.fc1(x)))


@pytest.fixture
def captured(monkeypatch) -> list[bool]:
    """The modes the concrete-shape capture records, in order."""
    modes, record_concrete = [], host.record_concrete

    def counted(module, name, args, kwargs, training, **options):
        modes.append(training)
        return record_concrete(module, name, args, kwargs, training, **options)

    monkeypatch.setattr(host, "record_concrete", counted)
    return modes


def test_a_capture_that_finds_no_more_groups_in_train_mode_is_not_made_in_eval_mode(captured) -> None:
    found = analyse(Blocks(helper=False, shared=True).eval(), (torch.randn(2, 5, HIDDEN),))
    assert captured == [True]
    assert [(g.kind, g.max_count) for g in found.groups] == [("channel", FFN)]
    assert {use.front_end for use in found.front_ends.values()} == {FrontEnd.SYMBOLIC}
    why = " ".join(r for lo in found.left_out for r in lo.reasons)
    assert "a parameter shared by layers cannot be sliced" in why, why


def test_a_capture_that_finds_more_groups_records_each_mode_once(captured) -> None:
    found = analyse(Blocks(helper=True, shared=False).eval(), (torch.randn(2, 5, HIDDEN),))
    assert captured == [True, False]
    assert sorted((g.kind, g.max_count) for g in found.groups) == [("channel", FFN), ("head", HEADS), ("head", HEADS)]
    assert [use.front_end for use in found.front_ends.values()] == [FrontEnd.CONCRETE]
    assert all("the symbolic trace left out: attend" in use.why for use in found.front_ends.values())
