"""The one self-check every group passes on the live model before it is offered: a clone must leave
the host's outputs unchanged, and a removal must equal masking the unit at its tap point (and keep output shapes)."""
from __future__ import annotations

import itertools

import torch

from ..capture.calls import forked_rng, materialize, training_mode
from ..compat import tree_leaves
from ..editing import Editor
from ..groups import UnitGroup
from ..slicing import ParamSlice, by_tensor, clone_unit


def self_check(editor: Editor, g: UnitGroup, inputs: tuple[tuple, dict]) -> str | None:
    """Clone and remove unit 0 on the live host, compare its outputs, and restore everything. A clone must leave the
    outputs unchanged; a removal must equal zeroing unit 0 at the group's tap point, which must see it at every
    point it enters the others (the tap is a hook on the graph's values, the removal slices of tensors: two
    independent paths). Where no removal is compared (an inexact group, or one at its minimum count, such as a
    single FFN channel), the tap is compared with masking unit 0 at every output slice instead (the projection's
    columns, a head-mixing map's read rows). Returns what went wrong, or None."""
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

    try:
        with training_mode(module, False), forked_rng(tree_leaves((args, kwargs))):
            if g.exact:
                y0 = run()
                noise = editor.noise(g, 0, 0.5, None, True)
                editor.edit(g, count + 1, lambda sl, t: clone_unit(t, sl, count, 0, noise.get(sl.name)), None)
                err = max_rel_diff(y0, run())
                restore()
                if err > tol:
                    return f"a clone changed the outputs by {err:.2e}"
            handle = editor.tap_point(g).add(_zero_first_unit)
            try:
                y_tap = run()
            finally:
                handle.remove()
            removes = count - 1 >= g.min_count
            if not (g.exact and removes):
                y_mask = masked([sl for sl in g.slices if sl.output])
                err = max_rel_diff(y_mask, y_tap)
                if err > tol:
                    return f"zeroing unit 0 at its tap point differs from masking it by {err:.2e}"
            if not removes:
                return None
            rest = torch.arange(1, count)
            editor.edit(g, count - 1, lambda sl, t: sl.keep(t, count, rest), None)
            y_rm = run()
            if [y.shape for y in y_rm] != [y.shape for y in y_tap]:
                return "a removal changed the output shapes"
            err = max_rel_diff(y_tap, y_rm)
            if g.exact and err > tol:
                return f"a removal differs from masking by {err:.2e}"
    except Exception as e:  # report the group, keep the model usable
        return f"{type(e).__name__}: {e}"
    finally:
        restore()
    return None


def _zero_first_unit(a: torch.Tensor) -> None:
    a[..., 0, :] = 0


def max_rel_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    if [x.shape for x in a] != [y.shape for y in b]:
        return float("inf")
    scale = max([1.0] + [float(x.abs().max()) for x in a if x.numel()])
    return max([0.0] + [float((x - y).abs().max()) for x, y in zip(a, b) if x.numel()]) / scale
