"""Picking parts along a dim: split, chunk, unbind, narrow, select, indexing and item assignment."""
from __future__ import annotations

import operator
from typing import Any, NamedTuple

import torch
from torch.fx.node import Node

from ..constants import ConstantSpec, Site, Unsupported, set_path
from ..ids import align, compact, expand_dims, pairs, varies
from ..labeller import Label, Step
from .base import RULES, first_tensor, pin_all, register_rule, wrap_dim


def _slice_like(s: Step, dim: int) -> Any:
    """Ops that pick parts along one dim (split, chunk, unbind, narrow, select): run them on ids
    expanded along that dim."""
    x, xl = first_tensor(s)
    ids = align(xl.ids, x.dim())
    d = wrap_dim(dim, x.dim())
    args = [_picking(a, ids, d) for a in s.args[1:]]  # index_select's index
    kwargs = {k: _picking(v, ids, d) for k, v in s.kwargs.items()}
    ids = expand_dims(ids, x.shape, [d])
    fn = getattr(ids, s.node.target) if s.node.op == "call_method" else (lambda *a, **k: s.node.target(ids, *a, **k))
    res = fn(*args, **kwargs)
    if isinstance(res, (tuple, list)):
        return tuple(Label(compact(r), xl.param) for r in res)
    return Label(compact(res), xl.param)


@register_rule(torch.split, torch.chunk, torch.tensor_split, "split", "chunk", "tensor_split")
def split(s: Step) -> Any:
    dim = s.arg(2, "dim", 0)[0]
    return _slice_like(s, dim)


@RULES.constants(torch.split, "split")
def split_constants(site: Site) -> list[ConstantSpec]:
    if site.in_dim is None:
        return []
    n = site.node
    dim = (n.args[2] if len(n.args) > 2 else n.kwargs.get("dim", 0)) % len(site.in_shape)
    if dim != site.in_dim:
        return []
    sizes = n.args[1] if len(n.args) > 1 else n.kwargs.get("split_size_or_sections", n.kwargs.get("split_size"))
    if isinstance(sizes, int) and len(n.args) > 1 and sizes:  # equal sections: made explicit, so that at zero
        site.constant(("args", 1), sizes)  # units each section is empty instead of one section holding all
        set_path(n, ("args", 1), [sizes] * (site.in_shape[dim] // sizes))
        sizes = n.args[1]
    segment = site.input_segment()
    if isinstance(sizes, int) or isinstance(sizes, Node):
        if segment is not None:
            raise Unsupported(f"{n.name}: equal sections of an axis that holds other coordinates beside the units")
        return [site.constant(("args", 1), _literal_size(site, sizes))]
    if segment is None:
        return [site.constant(("args", 1, k), _literal_size(site, v)) for k, v in enumerate(sizes)]
    return _sections_in(site, segment, [_literal_size(site, v) for v in sizes])


def _sections_in(site: Site, segment: tuple[int, int], sizes: list[int]) -> list[ConstantSpec]:
    """The sections of a split that fall in the units' segment of the axis follow the count; the others hold other
    coordinates (another group's, in a fused projection) and are left to them. A section across the segment's edge
    cannot follow either."""
    found, at = [], 0
    for k, size in enumerate(sizes):
        end = at + size
        if segment[0] <= at and end <= segment[1] and size:
            found.append(site.constant(("args", 1, k), size))
        elif at < segment[1] and segment[0] < end:
            raise Unsupported(f"{site.node.name}: section {k} holds units and other coordinates")
        at = end
    return found


def _literal_size(site: Site, v: Any) -> int:
    if isinstance(v, Node):
        raise Unsupported(f"{site.node.name}: split size computed at run time on the unit axis")
    return v


@register_rule(torch.unbind, "unbind")
def unbind(s: Step) -> Any:
    return _slice_like(s, s.arg(1, "dim", 0)[0])


@register_rule(torch.narrow, torch.select, torch.index_select, "narrow", "select", "index_select")
def narrow(s: Step) -> Any:
    return _slice_like(s, s.arg(1, "dim", 0)[0])


@RULES.constants(torch.narrow, "narrow")
def narrow_constants(site: Site) -> list[ConstantSpec]:
    if site.in_dim is None:
        return []
    dim = site.node.args[1] % len(site.in_shape)
    if dim != site.in_dim:
        return []
    return [site.constant(("args", 2), site.node.args[2]), site.constant(("args", 3), site.node.args[3])]


def _picking(entry: Any, ids: torch.Tensor, dim: int | None) -> Any:
    """An index entry as it picks ``ids`` along ``dim``: as given where its values are known. Where they are not (a
    meta tensor, when the graph is labelled by shapes alone), zeros of its shape if the ids do not vary along ``dim``
    (every position holds the same ids), else an error, so that the graph is labelled again on real values: indexing
    a tensor of ids by a meta tensor does not fail, it reads memory never written."""
    if not (torch.is_tensor(entry) and entry.is_meta):
        return entry
    if entry.dtype == torch.bool or dim is None or varies(ids, dim):
        raise ValueError("an index whose values are unknown (meta) picks ids that vary")
    return torch.zeros(entry.shape, dtype=entry.dtype)


def _with_known_values(index: Any, ids: torch.Tensor) -> Any:
    """``index`` (of ``__getitem__``) with each entry as it picks ``ids`` (``_picking``)."""
    entries = iter(index_dims(index, ids.dim()))
    items = index if isinstance(index, tuple) else (index,)
    known = tuple(e if e is Ellipsis else _picking(e, ids, next(entries).dim) for e in items)
    return known if isinstance(index, tuple) else known[0]


class IndexEntry(NamedTuple):
    """One entry of a ``__getitem__`` index and the input dim it applies to (None: a new axis)."""

    dim: int | None
    entry: Any


def _is_mask(e: Any) -> bool:
    return torch.is_tensor(e) and e.dtype == torch.bool


def index_dims(index: Any, ndim: int) -> list[IndexEntry]:
    """Pair each entry of a ``__getitem__`` index (Ellipsis expanded away) with its input dim."""
    if not isinstance(index, tuple):
        index = (index,)
    used = sum(1 for e in index if e is not None and e is not Ellipsis and not _is_mask(e))
    used += sum(e.dim() for e in index if _is_mask(e))
    out, d = [], 0
    for e in index:
        if e is Ellipsis:
            d += ndim - used
        elif e is None:
            out.append(IndexEntry(None, e))
        else:
            out.append(IndexEntry(d, e))
            d += e.dim() if _is_mask(e) else 1
    return out


def _written_out(entries: list[IndexEntry]) -> list[IndexEntry]:
    """The index with the dims an Ellipsis spanned written out as full slices, so it applies to the ids as given."""
    out, next_dim = [], 0
    for d, e in entries:
        if d is not None:
            out += [IndexEntry(k, slice(None)) for k in range(next_dim, d)]
            next_dim = d + (e.dim() if _is_mask(e) else 1)
        out.append(IndexEntry(d, e))
    return out


@register_rule(operator.getitem, always=True)
def getitem(s: Step) -> Any:
    src, idx = s.args[0], s.args[1]
    if s.node.args[0] in s.rec.size_reads:
        s.rec.size_reads.add(s.node)
    if isinstance(s.largs[0], tuple):  # an element of a multi-output op
        return s.largs[0][idx]
    if not torch.is_tensor(src) or s.largs[0] is None:
        return None
    xl: Label = s.largs[0]
    if isinstance(s.node.args[1], Node) and s.lab.labels.get(s.node.args[1]) is not None:
        pin_all(s, "indexing by a labelled tensor")
        return None
    ids = align(xl.ids, src.dim())
    idx = _with_known_values(idx, ids)
    touched = [d for d, e in index_dims(idx, src.dim()) if d is not None
               and not (isinstance(e, slice) and e == slice(None))]
    ids = expand_dims(ids, src.shape, touched)
    res = ids[idx]
    if tuple(res.shape) != tuple(s.out.shape) and res.dim() != s.out.dim():
        pin_all(s, "index pattern not understood")
        return None
    return Label(compact(res), xl.param)


@RULES.constants(operator.getitem)
def getitem_constants(site: Site) -> list[ConstantSpec]:
    if site.in_dim is None:
        return []
    idx = site.node.args[1]
    entries = index_dims(idx, len(site.in_shape))
    places = [k for k, e in enumerate(idx) if e is not Ellipsis] if isinstance(idx, tuple) else [None]
    out = []
    for k, (d, e) in enumerate(entries):
        if d != site.in_dim:
            continue
        if isinstance(e, slice):
            if e.step not in (None, 1):
                raise Unsupported(f"{site.node.name}: strided slice on the unit axis")
            base = ("args", 1, places[k]) if isinstance(idx, tuple) else ("args", 1)  # its place in the index
            for part in ("start", "stop"):
                v = getattr(e, part)
                if v is None or v == 0 or _to_the_end(part, v, site.in_shape[site.in_dim]):
                    continue
                if isinstance(v, int) and v < 0:
                    raise Unsupported(f"{site.node.name}: negative slice bound on the unit axis")
                out.append(site.constant(base + (part,), v if isinstance(v, int) else site.values[v]))
        elif e is not None:
            raise Unsupported(f"{site.node.name}: indexing picks single positions on the unit axis")
    return out


def _to_the_end(part: str, bound: Any, size: int) -> bool:
    """A stop past the axis's size (``torch.export``'s lowered ``x[:, :]`` stops at ``sys.maxsize``): the slice
    runs to the end at every count, so it is no count constant."""
    return part == "stop" and isinstance(bound, int) and bound > size


@register_rule(operator.setitem)
def setitem(s: Step) -> None:
    """``target[index] = value``: the written region of a labelled target takes the value's coordinates
    (tied); coordinates written into a plain tensor cannot be followed."""
    target, index, _ = s.args
    tl, vl = s.largs[0], s._label_at(s.node.args[2], s.largs[2])
    if tl is None:
        if vl is not None:
            s.rec.pin(vl.ids, f"{s.name}: units written into a plain tensor")
        return None
    if vl is None:
        return None
    ids = align(tl.ids, target.dim())
    entries = index_dims(_with_known_values(index, ids), target.dim())
    touched = [d for d, e in entries if d is not None and ids.shape[d] == 1 and not isinstance(e, slice)]
    ids = expand_dims(ids, target.shape, touched)
    compact_index = tuple(slice(None) if d is not None and isinstance(e, slice) and ids.shape[d] == 1 else e
                          for d, e in _written_out(entries))
    region = ids[compact_index]
    s.rec.tie(pairs(region, align(vl.ids, region.dim())))
    return None
