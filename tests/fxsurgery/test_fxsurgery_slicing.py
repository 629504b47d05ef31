"""Unit edits along a ``[outer][unit][inner]`` segment: ``keep`` and ``append`` equal a gather of the positions each
unit owns, worked out element by element (not through the views the edits use), whatever the runs of the index."""
from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from fxsurgery.slicing import MAX_RUNS, ParamSlice, solve_counts


def positions(sl: ParamSlice, count: int, units: list[int]) -> list[int]:
    """The dim's positions of ``units`` (in that order) within the group's segment, before/after kept around it."""
    inside = [sl.start + o * count * sl.inner + u * sl.inner + r
              for o in range(sl.outer) for u in units for r in range(sl.inner)]
    end = sl.start + sl.outer * count * sl.inner
    return [*range(sl.start), *inside, *range(end, end + sl.after)]


@st.composite
def slices(draw: st.DrawFn) -> tuple[ParamSlice, int, torch.Tensor]:
    count = draw(st.integers(1, 12))
    sl = ParamSlice("w", dim=draw(st.integers(0, 2)), outer=draw(st.integers(1, 3)), inner=draw(st.integers(1, 3)),
                    output=False, start=draw(st.integers(0, 2)), after=draw(st.integers(0, 2)))
    shape = [draw(st.integers(1, 3)) for _ in range(3)]
    shape[sl.dim] = sl.start + sl.outer * count * sl.inner + sl.after
    return sl, count, torch.randn(shape, dtype=torch.float64)


@given(slices(), st.data())
def test_keep_equals_the_gather_of_the_kept_units_positions(case, data):
    sl, count, t = case
    removed = data.draw(st.integers(0, count - 1))
    shuffled = data.draw(st.booleans())  # in order: a few runs, copied run by run; shuffled: often one gather
    kept = [u for u in range(count) if u != removed]
    if shuffled:
        kept = data.draw(st.permutations(kept))
    out = sl.keep(t, count, torch.tensor(kept, dtype=torch.long))
    want = t.index_select(sl.dim, torch.tensor(positions(sl, count, kept), dtype=torch.long))
    assert torch.equal(out, want)


def test_keep_of_more_runs_than_copied_one_by_one_still_gathers():
    sl, count = ParamSlice("w", dim=1, outer=1, inner=1, output=False), 4 * MAX_RUNS
    t = torch.randn(3, count)
    kept = list(range(0, count, 2))  # MAX_RUNS * 2 runs of one unit
    assert torch.equal(sl.keep(t, count, torch.tensor(kept)), t[:, kept])


@given(slices())
def test_append_puts_the_new_unit_last_in_every_outer_block(case):
    sl, count, t = case
    new = torch.randn_like(sl.unit(t, count, 0))
    out = sl.append(t, count, new)
    assert torch.equal(out.index_select(sl.dim, torch.tensor(positions(sl, count + 1, list(range(count))))), t)
    assert torch.equal(sl.unit(out, count + 1, count), new)


@st.composite
def layers(draw: st.DrawFn) -> tuple[list[list[ParamSlice]], list[int]]:
    """Groups over a few tensors: each group has a dim of its own (its output projection's columns) and some share a
    fused projection's rows with other groups, one segment each, beside rows no group holds; and their counts."""
    groups_count = draw(st.integers(1, 6))
    counts = [draw(st.integers(0, 5)) for _ in range(groups_count)]
    fused = draw(st.lists(st.integers(0, 2), min_size=groups_count, max_size=groups_count))  # which fused tensor
    groups = []
    for i in range(groups_count):
        own = ParamSlice(f"out{i}", 1, 1, draw(st.integers(1, 3)), True)
        shared = ParamSlice(f"qkv{fused[i]}", 0, draw(st.integers(1, 2)), draw(st.integers(1, 3)), False,
                            fixed=fused[i])
        groups.append([own, shared] if draw(st.booleans()) else [own])
    return groups, counts


@given(layers())
def test_counts_are_solved_from_the_sizes_block_by_block(drawn) -> None:
    """``solve_counts`` finds every group's count from the sizes its slices imply (groups sharing a fused
    projection's rows are solved together, the others alone), and None where a size contradicts them."""
    groups, counts = drawn
    sizes: dict[tuple[str, int], int] = {}
    for slices, count in zip(groups, counts):
        for sl in slices:
            sizes[(sl.name, sl.dim)] = sizes.get((sl.name, sl.dim), sl.fixed) + sl.outer * sl.inner * count
    assert solve_counts(groups, lambda name, dim: sizes[(name, dim)]) == counts
    own = groups[0][0]  # one more unit's columns in group 0's output projection
    wider = {**sizes, (own.name, own.dim): sizes[(own.name, own.dim)] + own.inner}
    solved = solve_counts(groups, lambda name, dim: wider[(name, dim)])
    # its rows of a fused projection then contradict the columns; alone, it has one unit more
    assert solved == (None if len(groups[0]) > 1 else [counts[0] + 1, *counts[1:]])
