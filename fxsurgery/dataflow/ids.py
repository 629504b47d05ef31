"""Id tensors: the analysis runs each op on tensors of unit-coordinate ids instead of data.

An id tensor has the rank of the value it describes. A dim along which the ids do not vary is kept
at size 1 (it broadcasts), so id tensors stay small. ``NO_ID`` marks positions that carry no unit
coordinate.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

NO_ID = -1


def align(ids: torch.Tensor, ndim: int) -> torch.Tensor:
    """Prepend size-1 dims so ``ids`` has rank ``ndim`` (right-aligned broadcasting)."""
    if ids.dim() > ndim:
        raise ValueError(f"id tensor of rank {ids.dim()} for a value of rank {ndim}")
    return ids.reshape((1,) * (ndim - ids.dim()) + tuple(ids.shape))


def compact(ids: torch.Tensor) -> torch.Tensor:
    """Shrink every dim along which the ids do not vary back to size 1."""
    for d in range(ids.dim()):
        if ids.shape[d] > 1 and bool((ids == ids.narrow(d, 0, 1)).all()):
            ids = ids.narrow(d, 0, 1)
    return ids


def varies(ids: torch.Tensor, dim: int) -> bool:
    """True when the ids change along ``dim``."""
    return ids.shape[dim] > 1 and not bool((ids == ids.narrow(dim, 0, 1)).all())


def expand_dims(ids: torch.Tensor, shape: Sequence[int], dims: Sequence[int]) -> torch.Tensor:
    """Expand the size-1 ``dims`` of ``ids`` to the value's real ``shape``."""
    target = list(ids.shape)
    for d in dims:
        target[d] = shape[d]
    return ids.expand(target)


def reshape_blocks(in_shape: Sequence[int], out_shape: Sequence[int]) -> list[tuple[range, range]]:
    """Pair runs of input dims with runs of output dims of equal element count."""
    if 0 in in_shape or 0 in out_shape:
        return [(range(len(in_shape)), range(len(out_shape)))]
    blocks, i, j = [], 0, 0
    while i < len(in_shape) or j < len(out_shape):
        si, sj, pi, pj = i, j, 1, 1
        if i < len(in_shape):
            pi, i = pi * in_shape[i], i + 1
        if j < len(out_shape):
            pj, j = pj * out_shape[j], j + 1
        while pi != pj:
            if pi < pj and i < len(in_shape):
                pi, i = pi * in_shape[i], i + 1
            elif pj < pi and j < len(out_shape):
                pj, j = pj * out_shape[j], j + 1
            else:
                return [(range(len(in_shape)), range(len(out_shape)))]
        blocks.append((range(si, i), range(sj, j)))
    return blocks


def reshape_ids(ids: torch.Tensor, in_shape: Sequence[int], out_shape: Sequence[int]) -> torch.Tensor:
    """Reshape ids like a value of ``in_shape`` reshaped to ``out_shape``, expanding only the runs of
    dims that actually carry varying ids."""
    src, dst = list(ids.shape), [1] * len(out_shape)
    for ins, outs in reshape_blocks(in_shape, out_shape):
        if any(ids.shape[d] > 1 for d in ins):
            for d in ins:
                src[d] = in_shape[d]
            for d in outs:
                dst[d] = out_shape[d]
    return ids.expand(src).reshape(dst)


def broadcast_base(t: torch.Tensor) -> torch.Tensor:
    """``t`` without the dims it repeats by broadcasting (stride 0, size over 1): ``t`` is it expanded to ``t``'s
    shape."""
    for d, (size, stride) in enumerate(zip(t.shape, t.stride())):
        if stride == 0 and size > 1:
            t = t.narrow(d, 0, 1)
    return t


def broadcast(*ids: torch.Tensor) -> list[torch.Tensor]:
    ndim = max(t.dim() for t in ids)
    return list(torch.broadcast_tensors(*(align(t, ndim) for t in ids)))


_SHIFT = 1 << 31  # ids (and NO_ID) shifted by one stay in [0, 2**31): a pair packs into one int64
_FEW = 4096  # positions below which dropping repeated slices costs more than the pairs it saves


def unique_pairs(p: torch.Tensor) -> torch.Tensor:
    """Distinct rows of an (k, 2) id tensor, in ascending order (one 1-D sort instead of a row sort; none where
    the rows already ascend: a fresh parameter's ids beside an activation's)."""
    if p.shape[0] < 2:
        return p
    packed = (p[:, 0] + 1) * _SHIFT + (p[:, 1] + 1)
    if bool((packed[1:] > packed[:-1]).all()):
        return p
    packed = torch.unique(packed)
    return torch.stack([packed // _SHIFT - 1, packed % _SHIFT - 1], dim=1)


def pairs(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distinct (a, b) id pairs at positions where both carry an id, as an (k, 2) tensor. A slice along a dim that
    repeats the one before it in both operands (or in the one that does not broadcast there) adds no pair: such
    slices go before the broadcast (a stream's ids repeat over its tokens, and every layer reads them)."""
    a, b = (align(t, max(a.dim(), b.dim())) for t in (a, b))
    if math.prod(max(m, n) for m, n in zip(a.shape, b.shape)) > _FEW:  # the broadcast size
        for d in range(a.dim()):
            a, b = _without_repeats([a, b], d)
    a, b = broadcast(a, b)
    keep = (a != NO_ID) & (b != NO_ID)
    if bool(keep.all()):  # the same pairs in the same order, without a masked copy
        return unique_pairs(torch.stack([a.reshape(-1), b.reshape(-1)], dim=1))
    return unique_pairs(torch.stack([a[keep], b[keep]], dim=1))


def _without_repeats(tensors: list[torch.Tensor], d: int) -> list[torch.Tensor]:
    """The ``tensors`` (broadcastable to each other) without the slices along ``d`` that repeat the slice before
    them in every tensor that varies along ``d``."""
    n = max(t.shape[d] for t in tensors)
    if n < 2:
        return tensors
    repeated = torch.ones(n - 1, dtype=torch.bool)
    for t in tensors:
        if t.shape[d] > 1:
            repeated &= (t.narrow(d, 1, n - 1) == t.narrow(d, 0, n - 1)).movedim(d, 0).reshape(n - 1, -1).all(1)
    kept = torch.cat([repeated.new_zeros(1), repeated]).logical_not().nonzero().flatten()
    return [t.index_select(d, kept) if t.shape[d] > 1 else t for t in tensors]


def fold(ids: torch.Tensor, dims: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Representative of the ids along ``dims`` (kept as size 1) and the pairs tying each id to it."""
    dims = [d for d in dims if ids.shape[d] > 1]
    if not dims:
        return ids, torch.empty(0, 2, dtype=torch.long)
    rep = ids.amax(dim=dims, keepdim=True)
    return rep, pairs(ids, rep)


def merge(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Elementwise combination: the result carries a's id where it has one, else b's; plus the pairs
    of positions where both carry ids (those coordinates are tied)."""
    ea, eb = broadcast(a, b)
    return compact(torch.where(ea != NO_ID, ea, eb)), pairs(a, b)
