"""Output projections as each test model's own layout names them (where a unit's columns are, independently of
fxsurgery's slices), and the group that writes through each."""
from __future__ import annotations

from typing import NamedTuple


class Projection(NamedTuple):
    """An output projection: its weight, the dim that meets the units, and a unit's width along it."""

    weight: str
    dim: int
    width: int


def layers(pattern: str, dim: int, width: int, n: int = 2) -> list[Projection]:
    """The projections of ``n`` layers, ``pattern`` formatted with the layer index."""
    return [Projection(pattern.format(i), dim, width) for i in range(n)]


def layer_groups(surgeon, heads: list[Projection], channels: list[Projection]) -> list[tuple[object, Projection]]:
    """Each group with the output projection it writes through (the one inside its module), heads first."""
    pairs = []
    for kind, projections in (("head", heads), ("channel", channels)):
        for p in projections:
            owners = [g for g in surgeon.groups if g.kind == kind and p.weight.startswith(g.module + ".")]
            assert len(owners) == 1, f"{p.weight}: {len(owners)} {kind} groups: {surgeon.explain()}"
            pairs.append((owners[0], p))
    return pairs
