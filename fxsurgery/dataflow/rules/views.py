"""Reshapes, dim moves and expands act on ids as on the value; reshape and expand hold unit-axis sizes."""
from __future__ import annotations

import operator

import torch
import torch.nn as nn
from torch.fx.node import Node

from ..constants import ConstantSpec, Site, Unsupported, get_path, shape_paths
from ..ids import align, compact, fold, reshape_blocks, reshape_ids
from ..labeller import Label, Step
from .base import COMPUTED_TENSOR, RULES, defer_pins, first_tensor, register_rule


@register_rule(torch.reshape, torch.flatten, torch.squeeze, torch.unsqueeze, torch.unflatten,
               "view", "reshape", "flatten", "unflatten", "squeeze", "unsqueeze", "view_as", "reshape_as",
               nn.Flatten)  # no sizes of its own (nn.Unflatten holds one: no rule, so it is refused)
def reshape(s: Step) -> Label | None:
    x, xl = first_tensor(s)
    if xl is None:  # only the shape source (view_as / reshape_as) carries ids
        return None
    ids = align(xl.ids, x.dim())
    return Label(compact(reshape_ids(ids, x.shape, s.out.shape)), xl.param)


def view_constants(site: Site) -> list[ConstantSpec]:
    """The shape entry of a reshape, view or expand that spans the unit axis."""
    if site.out_dim is None:
        return []
    paths = shape_paths(site.node, 1)
    shape = site.node.args[1] if len(site.node.args) == 2 else None
    if not paths and isinstance(shape, Node) and site.follows_units(shape):
        return []
    appended = _appended_literal(site, shape) if not paths and isinstance(shape, Node) else None
    if appended is not None:
        return [appended]
    if len(paths) != len(site.out_shape):
        raise Unsupported(f"{site.node.name}: shape built at run time; cannot rewrite the unit axis")
    value = get_path(site.node, paths[site.out_dim])
    if value == -1 and site.in_segment is not None and _split_alone(site) and site.input_segment():
        return []  # units and other coordinates cut into positions: the -1 counts both, whatever the count
    if (value == -1 or site.reads_unit_axis(value)) and _merges_positions(site):
        site.notes.append(f"{site.node.name}: the unit axis holds positions too, its size is inferred at run time")
        return []
    return [site.constant(paths[site.out_dim], site.out_shape[site.out_dim])]


def _appended_literal(site: Site, shape: Node) -> ConstantSpec | None:
    """``x.view(x.size()[:-k] + (width,))``: leading sizes read at run time, the rest literals appended to them;
    a unit axis among the literals is rewritten in the appended tuple (None if the shape is not built so)."""
    if shape.op != "call_function" or shape.target is not operator.add or len(shape.args) != 2:
        return None
    read, literals = shape.args
    if read not in site.size_reads or not isinstance(literals, tuple) or \
            not all(isinstance(k, int) for k in literals):
        return None
    k = site.out_dim - (len(site.out_shape) - len(literals))
    if k < 0:
        return None
    size = site.out_shape[site.out_dim]
    if size % site.count or literals[k] != size:
        raise Unsupported(f"{site.node.name}: size {literals[k]} on the unit axis is not {site.count} units")
    return ConstantSpec(shape, ("args", 1, k), size // site.count)


def _split_alone(site: Site) -> bool:
    """The output's unit axis comes from splitting the input's unit axis alone, the other sizes of the split
    literals (a fused projection viewed as (positions, head_dim), its query heads' positions beside the key's and
    value's)."""
    if site.in_dim is None or 0 in site.in_shape or 0 in site.out_shape:
        return False
    paths = shape_paths(site.node, 1)
    for ins, outs in reshape_blocks(site.in_shape, site.out_shape):
        if site.out_dim in outs:
            return list(ins) == [site.in_dim] and all(isinstance(get_path(site.node, paths[j]), int) and
                                                      get_path(site.node, paths[j]) > 0
                                                      for j in outs if j != site.out_dim)
    return False


def _merges_positions(site: Site) -> bool:
    """The output's unit axis also spans positions (heads folded into the batch): the input's unit axis
    repeats its coordinates, or it is merged with outer input dims along which no coordinates vary (inner
    ones may be a head's features, which carry the head's id). Its size follows the batch as well as the
    count, so no per-unit constant can stand for it."""
    if site.in_dim is None or site.in_ids is None or 0 in site.in_shape or 0 in site.out_shape:
        return False
    ids = align(site.in_ids, len(site.in_shape))
    along = ids.movedim(site.in_dim, -1).reshape(-1, ids.shape[site.in_dim])
    if ids.shape[site.in_dim] > 1 and any(torch.unique(row).numel() < row.numel() for row in along[:1]):
        return True
    for ins, outs in reshape_blocks(site.in_shape, site.out_shape):
        if site.out_dim in outs:
            return site.in_dim in ins and any(d < site.in_dim and ids.shape[d] == 1 and site.in_shape[d] > 1
                                              for d in ins)
    return False


@RULES.constants(torch.reshape, "view", "reshape")
def reshape_constants(site: Site) -> list[ConstantSpec]:
    """As ``view_constants``; a ``-1`` beside the unit axis would take the whole size at zero units, so
    the size it stands for is written in where it cannot depend on the count or on other input sizes."""
    found = view_constants(site)
    if site.out_dim is None:
        return found
    paths = shape_paths(site.node, 1)
    for k, path in enumerate(paths):
        if k == site.out_dim or get_path(site.node, path) != -1:
            continue
        merged = _merged_without_units(site, k)
        if _split_with_units(site, k) or merged == []:  # (merging no input dim: a size-1 dim of its own)
            site.write_size(path, site.out_shape[k])
        elif merged is not None:
            site.write_size_product(path, site.node.args[0], merged)
        else:
            site.notes.append(f"{site.node.name}: a -1 beside the unit axis is ambiguous at zero units")
    return found


def _split_with_units(site: Site, k: int) -> bool:
    """Output dim ``k`` comes from splitting the input's unit axis alone, beside the unit axis and literal
    sizes only: its size is the per-unit size divided by literals, fixed whatever the count."""
    if site.in_dim is None or 0 in site.in_shape or 0 in site.out_shape:
        return False
    paths = shape_paths(site.node, 1)
    for ins, outs in reshape_blocks(site.in_shape, site.out_shape):
        if k in outs:
            others = [j for j in outs if j not in (k, site.out_dim)]
            return (list(ins) == [site.in_dim] and site.out_dim in outs
                    and all(isinstance(get_path(site.node, paths[j]), int) for j in others))
    return False


def _merged_without_units(site: Site, k: int) -> list[int] | None:
    """The input dims that output dim ``k`` merges, when none of them is the unit axis (``x.view(-1, width)``
    over batch and tokens): the ``-1`` stands for their product, whatever the count."""
    if site.in_dim is None or 0 in site.in_shape or 0 in site.out_shape or not isinstance(site.node.args[0], Node):
        return None
    for ins, outs in reshape_blocks(site.in_shape, site.out_shape):
        if k in outs:
            return list(ins) if list(outs) == [k] and site.in_dim not in ins else None
    return None


@RULES.constants(torch.unflatten, "unflatten")
def unflatten_constants(site: Site) -> list[ConstantSpec]:
    if site.out_dim is None or site.in_dim is None:
        return []
    dim = site.node.args[1] % len(site.in_shape)
    if site.in_dim != dim:
        return []
    k = site.out_dim - dim
    return [site.constant(("args", 2, k), site.out_shape[site.out_dim])]


@register_rule(torch.permute, torch.transpose, torch.movedim, torch.swapaxes, torch.t,
               "permute", "transpose", "movedim", "swapaxes", "t", "swapdims")
def move_dims(s: Step) -> Label:
    """Dim moves act on ids exactly as on the value."""
    x, xl = first_tensor(s)
    ids = align(xl.ids, x.dim())
    rest_args = s.args[1:]
    if s.node.op == "call_method":
        out = getattr(ids, s.node.target)(*rest_args, **s.kwargs)
    else:
        out = s.node.target(ids, *rest_args, **s.kwargs)
    return Label(out, xl.param)


@register_rule(torch.view_as_complex)
def complex_pairs(s: Step) -> Label:
    """``view_as_complex``: the last dim (size 2) becomes one complex element per pair. Complex arithmetic mixes a
    pair's two numbers, so their coordinates are tied into one, which the element carries; no unit axis can then
    run along the pair."""
    x, xl = first_tensor(s)
    pair, tie = fold(align(xl.ids, x.dim()), [x.dim() - 1])
    s.rec.tie(tie)
    return Label(pair.squeeze(-1), xl.param)


@register_rule(torch.view_as_real)
def real_pairs(s: Step) -> Label:
    """``view_as_real``: a new last dim of size 2 (real and imaginary part), both carrying the element's
    coordinate."""
    x, xl = first_tensor(s)
    return Label(align(xl.ids, x.dim()).unsqueeze(-1), xl.param)


@register_rule("expand", "expand_as", "broadcast_to", torch.broadcast_to, always=True)
def expand(s: Step) -> Label | None:
    """The expanded tensor's ids, repeated as its values are; the shape source of ``expand_as`` lends only its
    shape, so its ids go nowhere. A plain tensor broadcast along new dims (a mask the code computes, read by every
    head) gets fresh ids along them, held like a factory's fill: every slice along them is the same tensor, so it
    follows the units it lines up with by its size, a count constant."""
    x, xl = first_tensor(s)
    if xl is None:
        return _broadcast_fill(s, x) if s.node.target in ("expand", "broadcast_to", torch.broadcast_to) else None
    return Label(align(xl.ids, s.out.dim()), xl.param)


def _broadcast_fill(s: Step, x: torch.Tensor) -> Label | None:
    """Fresh ids for the plain floating or boolean tensor ``x`` that ``expand`` broadcast along new dims (integer
    ones, indices, stay plain), and a pin on the dims its own values vary along: units may lie along the new dims
    only. None where it broadcast along none."""
    if not torch.is_tensor(s.out) or not (s.out.is_floating_point() or s.out.dtype == torch.bool):
        return None
    before = (1,) * (s.out.dim() - x.dim()) + tuple(x.shape)
    if not any(was == 1 and size > 1 for was, size in zip(before, s.out.shape)):
        return None
    ids = s.rec.fresh(tuple(s.out.shape))
    s.rec.uniform.append(ids)
    s.rec.broadcasts.append(ids)
    defer_pins(s, ids, before, COMPUTED_TENSOR, benign=False)  # the dims its own values vary along hold no units
    return Label(ids, True)


@RULES.constants("expand")
def expand_constants(site: Site) -> list[ConstantSpec]:
    if site.out_dim is None:
        return []
    paths = shape_paths(site.node, 1)
    if paths and get_path(site.node, paths[site.out_dim]) == -1:
        return []
    return view_constants(site)  # also a shape read off another tensor (``x.expand(y.shape)``)
