"""A table that only lookups read (a vocabulary's embedding, ``F.embedding`` in a traced graph) takes no ids: the
embedding rule reads it by name, so labelling costs nothing in its size (a 128256 × 4096 table would take half a
billion ids, 4 GiB, and more in grouping), and the groups are those found before."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from fxsurgery import analyse
from fxsurgery.analysis.regions import find_regions
from fxsurgery.capture.calls import buffers_kept
from fxsurgery.dataflow.labeller import Labeller
from fxsurgery.dataflow.rules import RULES

VOCAB, DIM, HIDDEN = 1000, 16, 24


class LookedUp(nn.Module):
    """Token ids looked up in a table (``F.embedding``, as HF's embeddings trace), then an FFN whose channels are a
    group."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(VOCAB, DIM))
        self.fc1, self.fc2 = nn.Linear(DIM, HIDDEN), nn.Linear(HIDDEN, DIM)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = F.embedding(ids, self.table)
        return x + self.fc2(F.gelu(self.fc1(x)))


def _labelled(model: nn.Module) -> Labeller:
    (_, gm, values), = find_regions(model, ((torch.zeros(2, 5, dtype=torch.long),), {}), lambda *a: None)[0]
    lab = Labeller(gm, RULES, meta=True)
    with torch.no_grad(), buffers_kept(gm):
        lab.run(*values)
    return lab


def test_a_table_only_lookups_read_takes_no_ids() -> None:
    lab = _labelled(LookedUp())
    assert lab.rec.next_id < VOCAB * DIM // 4  # the FFN's ids, not one per table element
    assert [tuple(m.ids.shape) for m in lab.rec.members if m.name == "table"] == [(1, DIM)]  # its columns' space
    analysis = analyse(LookedUp(), (torch.zeros(2, 5, dtype=torch.long),))
    assert [(g.module, g.count) for g in analysis.groups] == [("", HIDDEN)]

