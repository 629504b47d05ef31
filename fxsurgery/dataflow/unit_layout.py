"""Whether unit indices along a tensor dim follow the regular ``[outer][unit][inner]`` layout a
``ParamSlice`` can cut, and why not, for humans."""
from __future__ import annotations

import torch


def layout(u: torch.Tensor, n: int) -> tuple[int, int] | None:
    """(outer, inner) when unit indices ``u`` along a dim follow ``[outer][n][inner]``."""
    size = u.numel()
    if n == 0 or size % n or (u < 0).any():
        return None
    changes = (u != u[0]).nonzero()
    inner = int(changes[0]) if len(changes) else size  # the run of the first unit index
    if size % (n * inner):
        return None
    expected = (torch.arange(size) // inner) % n
    return (size // (n * inner), inner) if torch.equal(u, expected) else None


def segment(u: torch.Tensor) -> tuple[int, int] | None:
    """(start, stop) of the one run of positions that hold units among unit indices ``u`` along a dim (the others
    hold other coordinates: another group's, in a fused projection), or None if they hold units in several runs."""
    held = (u >= 0).nonzero().flatten()
    if not held.numel():
        return None
    start, stop = int(held[0]), int(held[-1]) + 1
    return (start, stop) if held.numel() == stop - start else None


def pieces(u: torch.Tensor, n: int) -> list[tuple[int, int, int, int]] | None:
    """(start, stop, outer, inner) of each piece of unit indices ``u`` along a dim laid out as ``[outer][n][inner]``,
    in order, where the positions that hold units (the others hold other groups' coordinates) are a run of such
    pieces: one for a plain projection, three for a fused q/k/v projection of grouped-query attention (its query
    rows hold each unit's query heads, its key and value rows one head per unit). None if a run is no such pieces."""
    held = (u >= 0).tolist()
    out, pos, size = [], 0, u.numel()
    while pos < size:
        if not held[pos]:
            pos += 1
            continue
        changes = (u[pos:] != u[pos]).nonzero()
        inner = int(changes[0]) if len(changes) else size - pos
        block = n * inner
        if block == 0 or pos + block > size:
            return None
        pattern = (torch.arange(block) // inner) % n
        fits = (size - pos) // block
        rows = u[pos:pos + fits * block].view(fits, block) == pattern
        outer = int(rows.all(dim=1).cumprod(0).sum())
        if outer == 0:
            return None
        out.append((pos, pos + outer * block, outer, inner))
        pos += outer * block
    return out or None


def describe_layout(u: torch.Tensor, n: int) -> str:
    """Why unit indices ``u`` along a dim are no ``[outer][unit][inner]`` layout, for humans."""
    present = torch.unique(u[u >= 0]).tolist()
    if len(present) < n:
        spans = ", ".join(f"{a}-{b}" if a != b else f"{a}" for a, b in _runs(present))
        return (f"holds units {spans} of {n} only (each part of the units has a parameter of its own, "
                f"so the units cannot be sliced as one layer)")
    return f"holds all {n} units, but not in an [outer][unit][inner] order"


def _runs(values: list[int]) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for v in values:
        if runs and v == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], v)
        else:
            runs.append((v, v))
    return runs
