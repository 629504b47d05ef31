"""Tensor edits along a unit axis laid out as ``[outer][unit][inner]``, and the optimizer state that
must follow them. Every edit is vectorised and touches only the group's own tensors."""
from __future__ import annotations

from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Callable, Sequence

import torch

from .errors import OptimizerStateError


@dataclass(frozen=True)
class ParamSlice:
    """A parameter or buffer of a group: unit i owns positions ``start + o·count·inner + i·inner + r`` along
    ``dim`` (o < outer, r < inner). ``output`` marks where the unit enters the others (the output projection's
    columns, a head-mixing map's dim that reads the head): split on a clone, zeroed to mask the unit. ``start``
    and ``after``: the group's units fill a segment of the dim, after ``start`` and before ``after`` elements of
    other groups (a fused projection's rows hold the units of several groups, one segment each); an edit of
    another group's segment moves them (``shifted``). ``fixed``: how many elements of the dim no group holds (a
    multi-query projection's key and value rows beside its query heads' segment); they stay whatever the counts."""

    name: str
    dim: int
    outer: int
    inner: int
    output: bool
    start: int = 0
    after: int = 0
    fixed: int = 0

    def segment(self, t: torch.Tensor, count: int) -> torch.Tensor:
        """View of the group's segment of ``t`` along ``dim``."""
        size = self.outer * count * self.inner
        if self.start + size + self.after != t.shape[self.dim]:
            raise ValueError(f"{self.name}: dim {self.dim} of size {t.shape[self.dim]} holds no segment of {count} "
                             f"units between {self.start} and {self.after} other elements")
        return t.narrow(self.dim, self.start, size) if self.start or self.after else t

    def units(self, t: torch.Tensor, count: int) -> torch.Tensor:
        """View of the group's segment of ``t`` with the unit index as its own axis at ``dim + 1``."""
        return self.segment(t, count).unflatten(self.dim, (self.outer, count, self.inner))

    def flat(self, v: torch.Tensor, t: torch.Tensor, count: int) -> torch.Tensor:
        """The units view ``v`` (a new segment) back in place of the group's segment of ``t``."""
        seg = v.flatten(self.dim, self.dim + 2)
        if not self.start and not self.after:
            return seg
        end = t.shape[self.dim] - self.after
        return _joined([t.narrow(self.dim, 0, self.start), seg, t.narrow(self.dim, end, self.after)], self.dim)

    def keep(self, t: torch.Tensor, count: int, index: torch.Tensor) -> torch.Tensor:
        """Only the units in ``index``, in that order (no zero slots). An index of a few runs of consecutive units
        (a removal keeps two) is copied run by run: a gather of single columns is many times slower."""
        v = self.units(t, count)
        runs = _runs(index)
        if runs is None:
            return self.flat(v.index_select(self.dim + 1, index.to(t.device)), t, count)
        return self.flat(_joined([v.narrow(self.dim + 1, start, size) for start, size in runs], self.dim + 1), t, count)

    def append(self, t: torch.Tensor, count: int, new: torch.Tensor) -> torch.Tensor:
        """``t`` with one more unit whose slice is ``new`` (shaped like one unit's slice)."""
        return self.flat(_joined([self.units(t, count), new.unsqueeze(self.dim + 1)], self.dim + 1), t, count)

    def unit(self, t: torch.Tensor, count: int, i: int) -> torch.Tensor:
        return self.units(t, count).select(self.dim + 1, i)

    def shifted(self, edited: ParamSlice, delta: int) -> ParamSlice:
        """This slice once the group of ``edited`` (another group's slice) grew by ``delta`` elements: a segment
        after its segment on the same dim moves by ``delta``, one before it has ``delta`` more elements after it (an
        empty segment where another starts lies before it)."""
        if (edited.name, edited.dim) != (self.name, self.dim) or not delta:
            return self
        if (self.start, -self.after) > (edited.start, -edited.after):
            return replace(self, start=self.start + delta)
        if (self.start, -self.after) < (edited.start, -edited.after):
            return replace(self, after=self.after + delta)
        return self


def moved_by(piece: ParamSlice, moves: Sequence[tuple[ParamSlice, int]]) -> ParamSlice:
    """``piece`` once each slice of ``moves`` (as it was) grew by its number of elements: every move is placed by
    where both lay before any of them (a group's own pieces of a dim move each other too)."""
    start, after = piece.start, piece.after
    for edited, delta in moves:
        if edited is not piece:
            shifted = piece.shifted(edited, delta)
            start, after = start + shifted.start - piece.start, after + shifted.after - piece.after
    return replace(piece, start=start, after=after) if (start, after) != (piece.start, piece.after) else piece


def solve_counts(groups: Sequence[Sequence[ParamSlice]], size: Callable[[str, int], int]) -> list[int] | None:
    """Each group's count (``groups``: the slices of each) from the sizes of the dims they slice (``size(name,
    dim)``): a dim's size is the sum, over the groups with a segment there, of width per unit × count, plus the
    elements no group holds (``fixed``; the segments of the groups offered tile the rest). None unless the sizes
    tell one whole count per group. Solved in exact arithmetic on Python numbers, so no tensor op runs (a forward
    being exported may ask)."""
    widths: dict[tuple[str, int], dict[int, int]] = {}
    fixed: dict[tuple[str, int], int] = {}
    for i, slices in enumerate(groups):
        for sl in slices:
            held = widths.setdefault((sl.name, sl.dim), {})
            held[i] = held.get(i, 0) + sl.outer * sl.inner  # a group's pieces of one dim add up
            fixed[(sl.name, sl.dim)] = sl.fixed
    if not groups or not widths:
        return [] if not groups else None
    counts: list[Fraction] = [Fraction(0)] * len(groups)
    for members, keys in _blocks(widths, len(groups)):  # groups that share no dim are solved apart
        rows = [[Fraction(widths[key].get(i, 0)) for i in members] + [Fraction(int(size(*key)) - fixed[key])]
                for key in keys]
        solved = _exact_solution(rows, len(members))
        if solved is None:
            return None
        for i, count in zip(members, solved):
            counts[i] = count
    if any(c.denominator != 1 or c < 0 for c in counts):
        return None
    return [int(c) for c in counts]


def _blocks(widths: dict[tuple[str, int], dict[int, int]], count: int) -> list[tuple[list[int], list[tuple]]]:
    """The groups linked by the dims they share, each block with its dims: the system ``solve_counts`` solves is
    block-diagonal, and each block is solved alone (a model's layers share no dim: one small system each)."""
    root = list(range(count))

    def find(i: int) -> int:
        while root[i] != i:
            root[i] = root[root[i]]
            i = root[i]
        return i

    for held in widths.values():
        first, *rest = held
        for i in rest:
            root[find(i)] = find(first)
    members: dict[int, list[int]] = {}
    for i in range(count):
        members.setdefault(find(i), []).append(i)
    keys: dict[int, list[tuple]] = {r: [] for r in members}
    for key, held in widths.items():
        keys[find(next(iter(held)))].append(key)
    return [(members[r], keys[r]) for r in members]


def _exact_solution(rows: list[list[Fraction]], unknowns: int) -> list[Fraction] | None:
    """The one solution of the linear system whose augmented rows are ``rows`` (Gauss–Jordan elimination), or None
    where an unknown is not determined or the rows contradict each other."""
    rows = [list(row) for row in rows]
    for col in range(unknowns):
        pivot = next((r for r in range(col, len(rows)) if rows[r][col]), None)
        if pivot is None:
            return None
        rows[col], rows[pivot] = rows[pivot], rows[col]
        rows[col] = [v / rows[col][col] for v in rows[col]]
        for r in range(len(rows)):
            if r != col and rows[r][col]:
                rows[r] = [a - rows[r][col] * b for a, b in zip(rows[r], rows[col])]
    if any(row[unknowns] for row in rows[unknowns:]):
        return None
    return [rows[k][unknowns] for k in range(unknowns)]


def by_tensor(slices: tuple[ParamSlice, ...] | list[ParamSlice]) -> list[tuple[str, list[ParamSlice]]]:
    """The slices of each tensor (two for a head-mixing map, sliced along both dims), in order of first appearance;
    ``output`` slices first, so a clone's split noise, drawn for the tensor as it was, fits its shape."""
    out: dict[str, list[ParamSlice]] = {}
    for sl in slices:
        out.setdefault(sl.name, []).append(sl)
    return [(name, sorted(group, key=lambda sl: not sl.output)) for name, group in out.items()]


def in_turn(fn: Callable[[ParamSlice, torch.Tensor], torch.Tensor], slices: list[ParamSlice],
            t: torch.Tensor) -> torch.Tensor:
    """``fn`` applied for each slice of one tensor in turn, each to the result of the one before (the edits of
    the dims of a head-mixing map compose: a clone splits its read row, then copies its produced column). An edit of
    one piece of a dim moves the group's later pieces there (a fused q/k/v projection's query, key and value rows)."""
    slices = list(slices)
    while slices:
        sl, *slices = slices
        before = t.shape[sl.dim]
        t = fn(sl, t)
        slices = [other.shifted(sl, t.shape[sl.dim] - before) for other in slices]
    return t


def unit_squares(t: torch.Tensor, slices: list[ParamSlice], count: int) -> torch.Tensor:
    """Sum of squares of each unit's elements of ``t``, shape ``(count,)``: an element a unit holds along two
    dims (its diagonal entry of a head-mixing map) counts once."""
    sq = t.float().square()
    total = sum(_per_unit(sl.units(sq, count), sl.dim + 1) for sl in slices)
    for k, a in enumerate(slices):
        for b in slices[k + 1:]:
            first, second = sorted((a, b), key=lambda sl: sl.dim)
            v = replace(second, dim=second.dim + 2).units(first.units(sq, count), count)
            total = total - torch.diagonal(v, dim1=first.dim + 1, dim2=second.dim + 3).flatten(0, -2).sum(0)
    return total


def _per_unit(v: torch.Tensor, axis: int) -> torch.Tensor:
    return v.sum(dim=[d for d in range(v.dim()) if d != axis])


def _joined(pieces: list[torch.Tensor], dim: int) -> torch.Tensor:
    """``torch.cat(pieces, dim)``, each piece copied into its place in one new tensor: on the CPU, cat along an inner
    dim with a piece one element wide is many times slower (a 768×3072 matrix less one column: 2.7 ms, and 20 ms
    with much memory in use, against 0.4 ms)."""
    shape = list(pieces[0].shape)
    shape[dim] = sum(piece.shape[dim] for piece in pieces)
    out = pieces[0].new_empty(shape)
    at = 0
    for piece in pieces:
        out.narrow(dim, at, piece.shape[dim]).copy_(piece)
        at += piece.shape[dim]
    return out


MAX_RUNS = 8  # more runs of consecutive units than this: one gather


def _runs(index: torch.Tensor) -> list[tuple[int, int]] | None:
    """(start, size) of each run of consecutive units in a host-side ``index``, if it has at most ``MAX_RUNS``."""
    if index.device.type != "cpu" or not index.numel():
        return None
    breaks = (torch.diff(index) != 1).nonzero().flatten() + 1  # where a new run starts
    if len(breaks) >= MAX_RUNS:
        return None
    starts = [0, *breaks.tolist()]
    ends = [*starts[1:], len(index)]
    first = index[starts].tolist()
    return [(k, end - start) for k, start, end in zip(first, starts, ends)]


# torch.optim optimizers whose per-parameter state is tensors shaped like their parameter, plus scalars: surgery
# slices and clones that state along with the parameter. The others keep state it cannot follow (LBFGS a flat
# history over all parameters, Adafactor factored row/column moments, SparseAdam sparse ones).
SHAPED_STATE_OPTIMIZERS = tuple(getattr(torch.optim, name) for name in (
    "SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "RMSprop", "Adadelta", "ASGD", "Rprop"))
SUPPORTED_STATE = (f"supported: {', '.join(cls.__name__ for cls in SHAPED_STATE_OPTIMIZERS)}, and any optimizer "
                   "whose per-parameter state tensors all have their parameter's shape")


def check_optimizer_layout(optimizer: torch.optim.Optimizer) -> None:
    """Refuse an optimizer built on a torch.optim one outside ``SHAPED_STATE_OPTIMIZERS`` (its state cannot follow
    a resize); one built on `torch.optim.Optimizer` alone is checked by the state it keeps."""
    torch_class = next(c for c in type(optimizer).__mro__ if c.__module__.startswith("torch.optim"))
    if torch_class is not torch.optim.Optimizer and not issubclass(torch_class, SHAPED_STATE_OPTIMIZERS):
        raise OptimizerStateError(f"{type(optimizer).__name__} keeps state that surgery cannot resize with the "
                                  f"parameters; {SUPPORTED_STATE}")


def state_tensors(optimizers: list[torch.optim.Optimizer], p: torch.Tensor) -> list[tuple[dict, str]]:
    """(state dict, key) of every per-element state tensor of ``p``; refuses state it cannot map."""
    out = []
    for opt in optimizers:
        st = opt.state.get(p)
        if not st:
            continue
        for k, v in st.items():
            held = v if isinstance(v, (list, tuple)) else [v]
            if not any(torch.is_tensor(t) and t.dim() > 0 for t in held):
                continue  # step counters and scalars stay as they are
            if not torch.is_tensor(v) or v.shape != p.shape:
                layout = f"shape {tuple(v.shape)}" if torch.is_tensor(v) else f"a {type(v).__name__} of tensors"
                raise OptimizerStateError(
                    f"{type(opt).__name__} state '{k}' has {layout} for a parameter of shape {tuple(p.shape)}; "
                    f"only state shaped like its parameter can be resized ({SUPPORTED_STATE})")
            out.append((st, k))
    return out


def clone_unit(t: torch.Tensor, sl: ParamSlice, count: int, parent: int, noise: torch.Tensor | None) -> torch.Tensor:
    """Copy the parent's slice as a new last unit; on output slices split it W/2 + ε and W/2 − ε."""
    v = sl.units(t, count)
    w = v.select(sl.dim + 1, parent)
    if not sl.output:
        return sl.append(t, count, w)
    half = w / 2
    eps = noise if noise is not None else torch.zeros_like(half)
    out = sl.append(t, count, half - eps)  # a new tensor: the parent's half is written into it
    sl.unit(out, count + 1, parent).copy_(half + eps)
    return out

