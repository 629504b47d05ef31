"""Softmaxes that weigh no heads, told at their module.

Attention's softmax weighs a query·key product that contracts head features. A softmax over feature groups
or positions of one tensor (a gate over kernel branches, channel groups or a spatial map), or over a product
that contracts positions only, has no heads; unless its units make a group, its module would be neither
grouped nor reported, and the user would not learn why it gives no units.
"""
from __future__ import annotations

from typing import NamedTuple, Protocol

import torch
import torch.fx

from .ids import varies
from .labeller import Labeller
from .paths import module_of
from .records import Records


class _Builder(Protocol):
    """What the check reads of the grouping's builder (``grouping._Builder``), named here since the grouping
    imports this module."""

    lab: Labeller
    rec: Records
    unit_class: torch.Tensor  # per class id: whether the class holds units
    head: torch.Tensor  # per class id: whether a query·key product contracts the class (heads)

    def cls(self, ids: torch.Tensor) -> torch.Tensor: ...


class Told(NamedTuple):
    """Why the softmax at ``node`` gives no heads."""

    node: torch.fx.Node
    reason: str


def silent_softmaxes(builder: _Builder, offered: torch.Tensor) -> list[Told]:
    """Each softmax that weighs no head (no feature coordinates a query·key product contracted) and none of
    whose units is ``offered`` as a group, with what it weighs."""
    products = _classes(builder, builder.rec.products)
    told = []
    for sm in builder.rec.softmaxes:
        c = builder.cls(sm.ids)
        units = torch.unique(c[c >= 0])
        units = units[builder.unit_class[units]]
        if not units.numel() or builder.head[units].any() or torch.isin(units, offered).any():
            continue
        of = f"the outputs of {', '.join(_producers(builder, sm.ids))}"
        if torch.isin(units, products).any():
            what = f"a product of two activations ({of}) that contracts positions, not head features"
        else:
            along = "feature groups" if varies(c, sm.dim) else "positions"
            what = f"{sm.size} {along} of one tensor ({of}), not over a query·key product"
        told.append(Told(sm.node, f"{sm.node.name}: no heads: a softmax over {what}"))
    return told


def _producers(builder: _Builder, ids: torch.Tensor) -> list[str]:
    """Modules of the linear maps whose outputs the softmax reads (its own ids, not all of their classes)."""
    raw = torch.unique(ids[ids >= 0])
    names = {sp.node for sp in builder.rec.spaces if ((raw >= sp.start) & (raw < sp.stop)).any()}
    return sorted({module_of(n) for n in builder.lab.module.graph.nodes if n.name in names})


def _classes(builder: _Builder, ids: list[torch.Tensor]) -> torch.Tensor:
    if not ids:
        return torch.empty(0, dtype=torch.long)
    c = builder.cls(torch.cat([t.flatten() for t in ids]))
    return torch.unique(c[c >= 0])
