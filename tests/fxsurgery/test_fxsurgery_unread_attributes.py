"""Blocks built alike that differ only in an attribute their analysed call does not read (HF's ``layer_idx``, read
only by a key/value cache's update) share one analysis, so that a deep model costs one block's analysis; a block
whose call reads it is analysed on its own; and a later call that reads it is not served by a graph captured from
another block's template (it holds that block's value): the block's own forward serves it."""
from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

import fxsurgery.analysis.model as model_module
from fxsurgery import Surgeon
from fxsurgery.analysis.host import fingerprint
from fxsurgery.capture.calls import attributes_read

DIM, HIDDEN = 8, 12


class Block(nn.Module):
    """An FFN block that reads its index only where a bias is passed (``reads_index``: always)."""

    def __init__(self, index: int, reads_index: bool = False):
        super().__init__()
        self.index, self.reads_index = index, reads_index
        self.fc1, self.fc2 = nn.Linear(DIM, HIDDEN), nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if bias is not None or self.reads_index:
            x = x + (0 if bias is None else bias) * (self.index + 1)
        return x + self.fc2(F.gelu(self.fc1(x)))


class Stack(nn.Module):
    def __init__(self, reads_index: bool = False):
        super().__init__()
        self.blocks = nn.ModuleList([Block(i, reads_index) for i in range(3)])

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, bias)
        return x


def test_the_attributes_a_call_reads_are_noted_and_the_classes_restored() -> None:
    block = Block(2)
    x = torch.randn(2, DIM)
    assert ("", "index") not in attributes_read(block, (x,), {})
    assert ("", "index") in attributes_read(block, (x,), {"bias": x})
    assert type(block) is Block and type(block.fc1) is nn.Linear
    assert fingerprint(Block(0), (x,), {}) == fingerprint(Block(1), (x,), {})
    assert fingerprint(Block(0), (x,), {"bias": x}) != fingerprint(Block(1), (x,), {"bias": x})


def test_blocks_differing_in_an_unread_attribute_share_one_analysis(monkeypatch) -> None:
    analysed = []
    original = model_module.analyse_host
    monkeypatch.setattr(model_module, "analyse_host", lambda module, host, *a, **k: (
        analysed.append(host), original(module, host, *a, **k))[1])
    x = torch.randn(2, 5, DIM)
    assert len(Surgeon(Stack(), (x,)).groups) == 3 and analysed == ["blocks.0"]
    analysed.clear()
    assert len(Surgeon(Stack(reads_index=True), (x,)).groups) == 3 and analysed == [f"blocks.{i}" for i in range(3)]


def test_a_call_that_reads_an_attribute_blocks_differ_in_runs_the_blocks_own_forward() -> None:
    torch.manual_seed(0)
    model = Stack()
    reference = copy.deepcopy(model)
    s = Surgeon(model, (torch.randn(2, 5, DIM),))
    x, bias = torch.randn(2, 5, DIM), torch.randn(2, 5, DIM)
    with torch.no_grad():
        assert torch.allclose(s.model(x, bias), reference(x, bias), atol=1e-6)
