"""The one self-check every group passes on the live model before it is offered: a clone must leave
the host's outputs unchanged, and a removal must equal masking the unit at its tap point (and keep output shapes)."""
from __future__ import annotations

import functools
import itertools

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
    shapes, on the CPU, standing in for its meta ones (``real_values``): the properties hold for any values, and one
    host is small. Returns what went wrong, or None."""
    with real_values(editor.host(g)):
        module = editor.host(g)
        args, kwargs = materialize(inputs)
        saved = [(t, t.data, t.grad) for t in itertools.chain(module.parameters(), module.buffers())]
        count = g.count
        dtype = saved[0][1].dtype if saved else torch.float32
        tol = {torch.float64: 1e-9, torch.float32: 1e-5}.get(dtype, 1e-2)

        def run() -> list[torch.Tensor]:
            with torch.no_grad():
                return [t for t in tree_leaves(module(*args, **kwargs)) if torch.is_tensor(t)]

        def restore() -> None:
            for t, data, grad in saved:
                t.data, t.grad = data, grad
            editor.settle(g, count)

        def tapped(unit: int) -> list[torch.Tensor]:
            """The outputs with ``unit`` zeroed at the group's tap point."""
            handle = editor.tap_point(g).add(functools.partial(_zero_unit, unit=unit))
            try:
                return run()
            finally:
                handle.remove()

        def clone_first() -> None:
            noise = editor.noise(g, 0, 0.5, None, True)
            editor.edit(g, g.count + 1, lambda sl, t: clone_unit(t, sl, g.count, 0, noise.get(sl.name)), None)

        def remove(unit: int) -> None:
            now = g.count
            rest = torch.tensor([k for k in range(now) if k != unit], dtype=torch.long)
            editor.edit(g, now - 1, lambda sl, t: sl.keep(t, now, rest), None)

        def masked(slices: list[ParamSlice]) -> list[torch.Tensor]:
            """The outputs with unit 0 of ``slices`` zeroed (in copies of their tensors)."""
            for name, group in by_tensor(slices):
                w = editor.tensor(name)
                w.data = w.data.clone()
                for sl in group:
                    sl.unit(w.data, count, 0).zero_()
            try:
                return run()
            finally:
                restore()

        def one_by_one() -> Reason | None:
            """Each property alone, on unit 0."""
            if g.exact:
                y0 = run()
                clone_first()
                err = max_rel_diff(y0, run())
                restore()
                if err > tol:
                    return Reason(f"a clone changed the outputs by {err:.2e}", module=g.module)
            y_tap = tapped(0)
            removes = count - 1 >= g.min_count
            if not (g.exact and removes):
                err = max_rel_diff(masked([sl for sl in g.slices if sl.output]), y_tap)
                if err > tol:
                    return Reason(f"zeroing unit 0 at its tap point differs from masking it by {err:.2e}",
                                  module=g.module)
            if not removes:
                return None
            remove(0)
            y_rm = run()
            if [y.shape for y in y_rm] != [y.shape for y in y_tap]:
                return Reason("a removal changed the output shapes", module=g.module)
            err = max_rel_diff(y_tap, y_rm)
            if g.exact and err > tol:
                return Reason(f"a removal differs from masking by {err:.2e}", module=g.module)
            return None

        try:
            with training_mode(module, False), forked_rng(tree_leaves((args, kwargs))):
                if g.exact and count >= 2 and count - 1 >= g.min_count:
                    y_tap = tapped(1)
                    clone_first()
                    remove(1)
                    y_both = run()
                    restore()
                    err = max_rel_diff(y_tap, y_both)
                    if err <= tol:
                        return None
                    return one_by_one() or Reason(f"a clone of unit 0 with unit 1 removed differs from masking unit 1 "
                                                  f"by {err:.2e}", module=g.module)
                return one_by_one()
        except Exception as e:  # report the group, keep the model usable
            return Reason(f"{type(e).__name__}: {e}", module=g.module)
        finally:
            restore()


def _zero_unit(a: torch.Tensor, unit: int) -> None:
    a[..., unit, :] = 0


def max_rel_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    if [x.shape for x in a] != [y.shape for y in b]:
        return float("inf")
    scale = max([1.0] + [float(x.abs().max()) for x in a if x.numel()])
    return max([0.0] + [float((x - y).abs().max()) for x, y in zip(a, b) if x.numel()]) / scale
