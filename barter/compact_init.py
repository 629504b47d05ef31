"""Compact initialisation at density rho: how many units each layer keeps, and which.

Widths ("allocation"): "uniform" keeps n_l,0 = max(1, rnd(rho * n_l^max)) units in every layer; "global" ranks
the units of all layers (heads and channels together) by importance per parameter, as global pruning ranks
them across layers, and keeps the best while their parameters fit the budget of the uniform allocation, each layer
keeping at least one unit.
Units ("init"): "first" (the lowest indices), "random" (a uniform subset), "magnitude" (the largest parameter
norms) or "score" (the largest D measured on calibration batches, `barter.calibration`).
"""
from __future__ import annotations

import math
from typing import Callable, Mapping, Sequence

import torch
from torch import Tensor

from .schedule import rnd

Importance = Callable[[object], Tensor]  # a group's per-unit importance: norms or calibrated D, shape (count,)


def initial_count(max_count: int, density: float) -> int:
    """Units a layer keeps at density rho (uniform per layer, at least one)."""
    return max(1, rnd(density * max_count))


def kept_units(count: int, keep: int, how: str, generator: torch.Generator,
               importance: Callable[[], Tensor]) -> list[int]:
    """Sorted indices of the `keep` units to retain out of `count`.

    "first": the lowest indices; "random": a uniform subset; "magnitude" and "score": the largest importance
    (`importance()`, the norms or the calibrated D, is only called for these), ties to the lower index.
    """
    if how == "first":
        return list(range(keep))
    if how == "random":
        chosen = torch.randperm(count, generator=generator)[:keep]
    else:
        chosen = torch.sort(importance().double().cpu(), descending=True, stable=True).indices[:keep]
    return sorted(int(i) for i in chosen)


def unit_cost(group, shapes: Mapping[str, Sequence[int]]) -> int:
    """Parameters one unit of `group` holds: what its tensors (those in `shapes`, the model's parameters, every
    group at its maximum count) lose when the group loses one unit (an element on two sliced dims counted once; a
    dim that holds other groups' segments too keeps theirs)."""
    dims: dict[str, dict[int, int]] = {}
    for sl in group.slices:
        dims.setdefault(sl.name, {})[sl.dim] = sl.outer * sl.inner
    cost = 0
    for name, sliced in dims.items():
        if name in shapes:
            less = [n - sliced.get(d, 0) for d, n in enumerate(shapes[name])]
            cost += math.prod(shapes[name]) - math.prod(less)
    return cost


def global_allocation(importances: Sequence[Tensor], costs: Sequence[int], budget: int) -> list[list[int]]:
    """The units each layer keeps (sorted indices) when all layers' units are ranked together by importance.

    Every layer first keeps its most important unit; then units are taken in order of decreasing importance per
    parameter (importance / cost of its layer; ties: lower layer, then lower index) whenever their cost still fits
    in `budget` (parameters): the greedy answer to keeping the most importance within a parameter budget. The kept
    units' parameters never exceed the budget, and a unit left out costs more than what remains of it.
    """
    if len(importances) != len(costs):
        raise ValueError(f"{len(importances)} layers of importance for {len(costs)} costs")
    kept = [[int(torch.sort(imp.double().cpu(), descending=True, stable=True).indices[0])] if len(imp) else []
            for imp in importances]
    spent = sum(cost for cost, units in zip(costs, kept) if units)
    if spent > budget:
        raise ValueError(f"a budget of {budget} parameters cannot keep one unit per layer ({spent})")
    flat = torch.cat([imp.double().cpu() / max(cost, 1) for imp, cost in zip(importances, costs)])
    layer_of = torch.repeat_interleave(torch.arange(len(importances)), torch.tensor([len(i) for i in importances]))
    offsets = [0, *torch.tensor([len(i) for i in importances]).cumsum(0).tolist()]
    for k in torch.sort(flat, descending=True, stable=True).indices.tolist():
        layer = int(layer_of[k])
        unit = k - offsets[layer]
        if unit != kept[layer][0] and spent + costs[layer] <= budget:
            kept[layer].append(unit)
            spent += costs[layer]
    return [sorted(units) for units in kept]


def compact(surgeon, layers: Mapping[str, Sequence], *, density: float, init: str, allocation: str,
            generator: torch.Generator, importance: Importance) -> dict[str, list[int]]:
    """Shrink every group of `layers` ({kind: groups}) to its initial width in place (one batched edit per group,
    the kept units in their original order); returns {group name: the indices of the units it kept}.

    "uniform" draws the random subsets kind after kind, group after group; "global" reads every group's
    importance before the first edit and prices units by `unit_cost` on the model's parameters.
    """
    groups = [g for kind in layers for g in layers[kind]]
    if allocation == "global":
        shapes = {name: tuple(p.shape) for name, p in surgeon.model.named_parameters()}
        costs = [unit_cost(g, shapes) for g in groups]
        budget = sum(cost * initial_count(g.max_count, density) for g, cost in zip(groups, costs))
        chosen = global_allocation([importance(g) for g in groups], costs, budget)
    else:
        chosen = [kept_units(g.count, initial_count(g.max_count, density), init, generator,
                             lambda g=g: importance(g)) for g in groups]
    for g, keep in zip(groups, chosen):
        if len(keep) < g.count:
            surgeon.keep(g, keep)
    return {g.name: keep for g, keep in zip(groups, chosen)}
