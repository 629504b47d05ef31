"""Compact initialisation at density rho: n_l,0 = max(1, rnd(rho * n_l^max)) units kept in every layer."""
from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import Tensor

from .schedule import rnd


def initial_count(max_count: int, density: float) -> int:
    """Units a layer keeps at density rho (uniform per layer, at least one)."""
    return max(1, rnd(density * max_count))


def kept_units(count: int, keep: int, how: str, generator: torch.Generator,
               norms: Callable[[], Tensor]) -> list[int]:
    """Sorted indices of the `keep` units to retain out of `count`.

    "first": the lowest indices; "random": a uniform subset; "magnitude": the largest parameter norms
    (`norms()` is only called for this one), ties to the lower index.
    """
    if how == "first":
        return list(range(keep))
    if how == "random":
        chosen = torch.randperm(count, generator=generator)[:keep]
    else:
        chosen = torch.sort(norms().double(), descending=True, stable=True).indices[:keep]
    return sorted(int(i) for i in chosen)


def compact(surgeon, groups: Sequence, density: float, how: str, generator: torch.Generator,
            norms: Callable[[object], Tensor]) -> list[int]:
    """Shrink every group in `groups` to its initial count in place (one batched edit per group, the
    kept units in their original order); returns those counts."""
    counts = []
    for g in groups:
        keep = kept_units(g.count, initial_count(g.max_count, density), how, generator, lambda g=g: norms(g))
        if len(keep) < g.count:
            surgeon.keep(g, keep)
        counts.append(g.count)
    return counts
