"""The one self-check every group passes on the live model before it is offered: a clone must leave
the host's outputs unchanged, and a removal must equal masking the unit at its tap point (and keep output shapes)."""
from __future__ import annotations

import functools
import itertools
from contextlib import contextmanager
from typing import Iterator

import torch

from ..capture.calls import forked_rng, materialize, real_values, training_mode
from ..compat import tree_leaves
from ..editing import Editor
from ..groups import UnitGroup
from ..reason import Reason
from ..slicing import ParamSlice, by_tensor, clone_unit


def self_check(editor: Editor, g: UnitGroup, inputs: tuple[tuple, dict]) -> Reason | None:
    """Clone and remove units on the live host, compare its outputs, and restore everything. A clone must leave the
    outputs unchanged; a removal must equal zeroing the unit at the group's tap point, which must see it at every
    point it enters the others (the tap is a hook on the graph's values, the removal slices of tensors: two
    independent paths). Both are checked in one forward where they can be: unit 0 cloned and unit 1 removed must
    equal unit 1 zeroed at the tap point; where that differs, each is checked alone to tell which is wrong. Where no
    removal is compared (an inexact group, or one at its minimum count, such as a single FFN channel), the tap is
    compared with masking unit 0 at every output slice instead (the projection's columns, a head-mixing map's read
    rows). A host on the meta device (a model built without memory) is checked with random values of its tensors'
    shapes, on the CPU, standing in for its meta ones (``real_values``), at a few units (``twin``): the properties hold
    for any values and any count. Returns what went wrong, or None."""
    host = editor.host(g)
    with twin(editor, g, host), real_values(host):
        trial = _Trial(editor, g, inputs)
        try:
            with training_mode(trial.module, False), forked_rng(tree_leaves((trial.args, trial.kwargs))):
                return trial.check()
        except Exception as e:  # report the group, keep the model usable
            return Reason(f"{type(e).__name__}: {e}", module=g.module)
        finally:
            trial.restore()


TWIN_UNITS = 4  # a meta host's group is checked at this many units (or its minimum and two more)


@contextmanager
def twin(editor: Editor, g: UnitGroup, host: torch.nn.Module) -> Iterator[None]:
    """A host on the meta device with the group cut to its first few units by the group's own edit (shapes only, no
    memory), so that the values standing in for it are a few MB, not a block of a large model at full width; then
    the host's tensors and the group's count as they were. A host (the group's) with real tensors is left as it is."""
    tensors = list(itertools.chain(host.parameters(), host.buffers()))
    units = min(g.count, max(TWIN_UNITS, g.min_count + 2)) if any(t.is_meta for t in tensors) else None
    if units is None or units == g.count:
        yield
        return
    saved, count = [(t, t.data) for t in tensors], g.count
    editor.edit(g, units, lambda sl, t: sl.keep(t, count, torch.arange(units)), None)
    try:
        yield
    finally:
        for t, data in saved:
            t.data = data
        editor.settle(g, count)


# the largest relative difference a trial accepts, by the host's dtype: a few dozen rounding steps through a block
# (bfloat16 keeps 8 bits, so a clone's halves and a sum over heads differ by a percent where float16 differs by 0.1%)
_TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 4e-2}


class _Trial:
    """The trial edits of one self-check on the group's live host, the outputs they give, and the restore that undoes
    them: `check` compares, the other methods each make one edit or one run."""

    def __init__(self, editor: Editor, g: UnitGroup, inputs: tuple[tuple, dict]) -> None:
        self.editor, self.g = editor, g
        self.module = editor.host(g)
        self.args, self.kwargs = materialize(inputs)
        self.saved = [(t, t.data, t.grad) for t in itertools.chain(self.module.parameters(), self.module.buffers())]
        self.count = g.count  # the count before any trial edit, restored after each
        dtype = self.saved[0][1].dtype if self.saved else torch.float32
        self.tol = _TOLERANCE.get(dtype, _TOLERANCE[torch.float16])

    def check(self) -> Reason | None:
        """Unit 0 cloned and unit 1 removed against unit 1 zeroed at the tap point, in one forward where the group
        allows both; each property alone where it does not, or where the two differ (to tell which is wrong)."""
        g = self.g
        if not (g.exact and self.count >= 2 and self.count - 1 >= g.min_count):
            return self.one_by_one()
        y_tap = self.tapped(1)
        self.clone_first()
        self.remove(1)
        y_both = self.run()
        self.restore()
        err = max_rel_diff(y_tap, y_both)
        if err <= self.tol:
            return None
        return self.one_by_one() or Reason(f"a clone of unit 0 with unit 1 removed differs from masking unit 1 "
                                           f"by {err:.2e}", module=g.module)

    def one_by_one(self) -> Reason | None:
        """Each property alone, on unit 0: the clone, the tap against masking (where no removal is compared), and
        the removal against the tap."""
        g = self.g
        if g.exact:
            y0 = self.run()
            self.clone_first()
            err = max_rel_diff(y0, self.run())
            self.restore()
            if err > self.tol:
                return Reason(f"a clone changed the outputs by {err:.2e}", module=g.module)
        y_tap = self.tapped(0)
        removes = self.count - 1 >= g.min_count
        if not (g.exact and removes):
            err = max_rel_diff(self.masked([sl for sl in g.slices if sl.output]), y_tap)
            if err > self.tol:
                return Reason(f"zeroing unit 0 at its tap point differs from masking it by {err:.2e}", module=g.module)
        return self.removal_against(y_tap) if removes else None

    def removal_against(self, y_tap: list[torch.Tensor]) -> Reason | None:
        """Unit 0 removed against the outputs with it zeroed at the tap point: the same shapes, and (for an exact
        group) the same values."""
        self.remove(0)
        y_rm = self.run()
        if [y.shape for y in y_rm] != [y.shape for y in y_tap]:
            return Reason("a removal changed the output shapes", module=self.g.module)
        err = max_rel_diff(y_tap, y_rm)
        if self.g.exact and err > self.tol:
            return Reason(f"a removal differs from masking by {err:.2e}", module=self.g.module)
        return None

    def run(self) -> list[torch.Tensor]:
        """The host's tensor outputs on the inputs, without gradients."""
        with torch.no_grad():
            return [t for t in tree_leaves(self.module(*self.args, **self.kwargs)) if torch.is_tensor(t)]

    def restore(self) -> None:
        """The host's tensors and gradients as they were, and the group at its count before the trial."""
        for t, data, grad in self.saved:
            t.data, t.grad = data, grad
        self.editor.settle(self.g, self.count)

    def tapped(self, unit: int) -> list[torch.Tensor]:
        """The outputs with ``unit`` zeroed at the group's tap point."""
        handle = self.editor.tap_point(self.g).add(functools.partial(_zero_unit, unit=unit))
        try:
            return self.run()
        finally:
            handle.remove()

    def clone_first(self) -> None:
        """Unit 0 copied as a new last unit, its output slices split W/2 + ε and W/2 − ε (the outputs unchanged)."""
        g = self.g
        noise = self.editor.noise(g, 0, 0.5, None, True)
        self.editor.edit(g, g.count + 1, lambda sl, t: clone_unit(t, sl, g.count, 0, noise.get(sl.name)), None)

    def remove(self, unit: int) -> None:
        """``unit`` removed at the group's current count."""
        now = self.g.count
        rest = torch.tensor([k for k in range(now) if k != unit], dtype=torch.long)
        self.editor.edit(self.g, now - 1, lambda sl, t: sl.keep(t, now, rest), None)

    def masked(self, slices: list[ParamSlice]) -> list[torch.Tensor]:
        """The outputs with unit 0 of ``slices`` zeroed (in copies of their tensors), then restored."""
        for name, group in by_tensor(slices):
            w = self.editor.tensor(name)
            w.data = w.data.clone()
            for sl in group:
                sl.unit(w.data, self.count, 0).zero_()
        try:
            return self.run()
        finally:
            self.restore()


def _zero_unit(a: torch.Tensor, unit: int) -> None:
    a[..., unit, :] = 0


def max_rel_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    if [x.shape for x in a] != [y.shape for y in b]:
        return float("inf")
    scale = max([1.0] + [float(x.abs().max()) for x in a if x.numel()])
    return max([0.0] + [float((x - y).abs().max()) for x, y in zip(a, b) if x.numel()]) / scale
