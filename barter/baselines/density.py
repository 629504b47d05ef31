"""Per-layer densities of unstructured sparse training: uniform, or Erdős–Rényi-kernel (ERK, Evci et al. 2020)."""
from __future__ import annotations

import math
from collections.abc import Sequence

DISTRIBUTIONS = ("erk", "uniform")


def erk_densities(shapes: Sequence[Sequence[int]], density: float) -> list[float]:
    """ERK: density_l = eps * (sum of dims / product of dims), eps chosen so that sum_l d_l n_l = density * sum_l n_l.

    As in RigL's `sparse_utils.get_sparsities`: while the layer with the largest raw density would exceed 1, it
    (with any tie) becomes dense and eps is recomputed over the remaining layers.
    """
    sizes = [math.prod(s) for s in shapes]
    raw = [sum(s) / n for s, n in zip(shapes, sizes)]
    dense: set[int] = set()
    eps = 0.0
    while len(dense) < len(shapes):
        rest = [i for i in range(len(shapes)) if i not in dense]
        budget = density * sum(sizes) - sum(sizes[i] for i in dense)
        eps = budget / sum(raw[i] * sizes[i] for i in rest)
        top = max(raw[i] for i in rest)
        if eps * top <= 1:
            break
        dense |= {i for i in rest if raw[i] == top}
    return [1.0 if i in dense else min(1.0, eps * raw[i]) for i in range(len(shapes))]


def layer_densities(shapes: Sequence[Sequence[int]], density: float, distribution: str = "erk") -> list[float]:
    """Per-layer densities of `distribution` ("erk" or "uniform") at overall `density`."""
    if distribution == "erk":
        return erk_densities(shapes, density)
    if distribution == "uniform":
        return [density] * len(shapes)
    raise ValueError(f"unknown distribution {distribution!r}; expected one of {DISTRIBUTIONS}")


def layer_counts(shapes: Sequence[Sequence[int]], density: float, distribution: str = "erk") -> list[int]:
    """Kept weights per layer: the densities rounded by largest remainder so the total is round(density * N)."""
    sizes = [math.prod(s) for s in shapes]
    ideal = [d * n for d, n in zip(layer_densities(shapes, density, distribution), sizes)]
    counts = [min(n, math.floor(x)) for x, n in zip(ideal, sizes)]
    short = round(density * sum(sizes)) - sum(counts)
    for i in sorted(range(len(sizes)), key=lambda i: (counts[i] - ideal[i], i)):
        if short <= 0:
            break
        if counts[i] < sizes[i]:
            counts[i] += 1
            short -= 1
    return counts
