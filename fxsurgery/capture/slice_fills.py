"""Fresh tensors filled piece by piece, read as the concatenation they are.

Code that assembles a tensor in place (``out = x.new_empty(...)``, then ``out[..., :n].copy_(a)`` and
``out[..., n:].copy_(b)``; latent attention builds its keys so) writes through views, which a dataflow over values
cannot follow: the written pieces reach the readers of ``out`` only by aliasing. Where the pieces tile one dim of
an uninitialised tensor exactly, in order, each of the shape and dtype it is written into, and nothing reads the
tensor before the last write, the ATen graph computes ``torch.cat(pieces, dim)`` instead: the same values, no
aliasing. Any other fill is left as recorded (the analysis then reports its ``copy_`` as having no rule).
"""
from __future__ import annotations

import sys
from typing import NamedTuple

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

aten = torch.ops.aten

_UNINITIALISED = (aten.new_empty.default, aten.empty.memory_format)
_VIEWS = (aten.slice.Tensor, aten.alias.default)  # a slice of the whole tensor is recorded as its alias


class Piece(NamedTuple):
    """One write of a fill: the slice ``[start, stop)`` of ``dim`` that ``copy`` writes ``value`` into."""
    start: int
    stop: int
    view: torch.fx.Node
    copy: torch.fx.Node
    value: torch.fx.Node


def fills_as_concatenation(graph: torch.fx.Graph) -> None:
    """Rewrite, in place, each exact piece-by-piece fill of an uninitialised tensor of ``graph`` (an ATen graph with
    export's fake values in ``node.meta['val']``) as one ``aten.cat`` of its pieces."""
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in _UNINITIALISED:
            _rewrite(graph, node)


def _rewrite(graph: torch.fx.Graph, fresh: torch.fx.Node) -> None:
    views = [u for u in fresh.users if u.op == "call_function" and u.target in _VIEWS]
    dims = {_dim(view, fresh) for view in views if view.target == aten.slice.Tensor} or {0}  # a whole view: any dim
    if not views or len(dims) != 1 or None in dims:
        return
    dim = dims.pop()
    size = fresh.meta["val"].shape[dim]
    if not isinstance(size, int):
        return
    pieces = sorted((p for view in views if (p := _piece(view, size)) is not None), key=lambda p: p.start)
    bounds = [(p.start, p.stop) for p in pieces]
    if (len(pieces) != len(views) or pieces[0].start != 0 or pieces[-1].stop != size
            or any(stop != start for (_, stop), (start, _) in zip(bounds, bounds[1:]))):
        return
    order = {n: k for k, n in enumerate(graph.nodes)}
    last = max((p.copy for p in pieces), key=order.__getitem__)
    readers = [u for u in fresh.users if u not in views]
    if any(order[reader] < order[last] for reader in readers):
        return  # read before it is whole: not a concatenation
    with graph.inserting_after(last):
        whole = graph.call_function(aten.cat.default, ([p.value for p in pieces], dim))
    whole.meta = dict(fresh.meta)
    for reader in readers:
        reader.replace_input_with(fresh, whole)
    for piece in pieces:
        graph.erase_node(piece.copy)
        graph.erase_node(piece.view)
    graph.erase_node(fresh)


def _dim(view: torch.fx.Node, fresh: torch.fx.Node) -> int | None:
    """The dim ``view`` slices of ``fresh``, counted from the front; None for a slice it cannot read."""
    dim = view.args[1] if len(view.args) > 1 else 0
    rank = fresh.meta["val"].dim()
    return dim % rank if isinstance(dim, int) and -rank <= dim < rank else None


def _piece(view: torch.fx.Node, size: int) -> Piece | None:
    """The write through ``view`` (its one user, a ``copy_`` whose result nothing reads, of a value of the view's
    shape and dtype) into a dim of ``size``, or None where the view is anything else."""
    start, stop, step = (*view.args[2:], None, None, 1)[:3]  # aten.slice(self, dim, start, end, step); an alias: all
    start = 0 if start is None else start
    stop = size if stop is None or (isinstance(stop, int) and stop >= sys.maxsize) else stop
    if not all(isinstance(b, int) and 0 <= b for b in (start, stop)) or step not in (None, 1) or len(view.users) != 1:
        return None
    copy = next(iter(view.users))
    if copy.op != "call_function" or copy.target != aten.copy_.default or copy.users or copy.args[0] is not view:
        return None
    value = copy.args[1]
    written, wanted = _val(value), _val(view)
    if written is None or wanted is None or written.dtype != wanted.dtype or not _same_shape(written, wanted):
        return None
    return Piece(start, min(stop, size), view, copy, value)


def _same_shape(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two fake values have the same shape at every call (symbolic sizes known equal)."""
    return a.dim() == b.dim() and all(statically_known_true(x == y) for x, y in zip(a.shape, b.shape))


def _val(node: object) -> torch.Tensor | None:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return val if torch.is_tensor(val) else None
