"""Concatenation, padding, reordering and repetition of positions."""
from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..constants import ConstantSpec, Path, Site, Unsupported, shape_paths
from ..ids import NO_ID, align, compact, expand_dims, fold, pairs
from ..labeller import Label, Step
from .base import RULES, defer_pins, first_tensor, register_rule, wrap_dim


class Piece(NamedTuple):
    """One input of a concatenation, shaped as it stands in the output (ids None: a plain tensor)."""

    ids: torch.Tensor | None
    param: bool
    shape: list[int]


@register_rule(torch.cat, torch.concat, torch.stack)
def cat(s: Step) -> Label | None:
    tensors, dim = s.args[0], s.arg(1, "dim", 0)[0]
    labels = s.largs[0]
    stack = s.node.target is torch.stack
    nd = s.out.dim()
    d = wrap_dim(dim, nd)
    pieces, plain_shapes = [], []
    for v, lab in zip(tensors, labels):
        if v.numel() == 0 and not stack:  # an empty piece (no prefix tokens: ``x[:, :0]``) adds no positions
            continue
        shape = list(v.shape)
        if stack:
            shape.insert(d, 1)
        if isinstance(lab, Label):
            ids = align(lab.ids, v.dim())
            ids = ids.unsqueeze(d) if stack else ids
            pieces.append(Piece(ids, lab.param, shape))
        else:
            pieces.append(Piece(None, False, shape))
            plain_shapes.append(shape)
    labelled = [p for p in pieces if p.ids is not None]
    if not pieces:
        return None
    if all(p.param for p in labelled) and plain_shapes:
        for p in labelled:
            s.rec.pin(p.ids, f"{s.name}: parameter concatenated with a plain activation", True)
        return None
    joined = _parameters_joined(s, labelled, d)
    if joined is not None:  # a class token beside the patches: the stream keeps one id per feature
        labelled, pieces = [joined], [p if p.ids is None or not p.param else p._replace(ids=joined.ids) for p in pieces]
    others = [max([p.ids.shape[k] for p in labelled] + [1]) if k != d else None for k in range(nd)]
    parts = []
    for p in pieces:
        target = [p.shape[k] if k == d else others[k] for k in range(nd)]
        if p.ids is None:
            parts.append(torch.full(target, NO_ID, dtype=torch.long))
        else:
            parts.append(p.ids.expand(target))
    out = compact(torch.cat(parts, dim=d))
    for shape in plain_shapes:
        defer_pins(s, out, [1 if k == d else shape[k] for k in range(nd)], "a concatenated plain tensor")
    return Label(out, all(p.param for p in labelled))


def _parameters_joined(s: Step, labelled: list[Piece], d: int) -> Piece | None:
    """Parameters concatenated to activations whose ids are the same at every position along ``d`` (a class
    token before the patch tokens): each parameter element joins the activations' coordinate at its place, as a
    parameter added to them would, and the result keeps the activations' ids at every position, so the stream's
    ids stay one per feature. None when the activations' ids differ along ``d`` or between pieces."""
    acts = [p for p in labelled if not p.param]
    params = [p for p in labelled if p.param]
    if not acts or not params or any(p.ids.shape[d] != 1 for p in acts):
        return None
    ids = acts[0].ids
    if any(not torch.equal(*torch.broadcast_tensors(ids, p.ids)) for p in acts[1:]):
        return None
    for p in params:
        s.rec.tentative.append(pairs(p.ids, ids))
    return acts[0]


@register_rule(F.pad)
def pad(s: Step) -> Label:
    """Padding along a dim whose positions carry different coordinates adds positions that carry none; along
    a dim whose positions all carry the same ones (space, beside the channels) the new positions are theirs
    too: they go with their channel."""
    x, xl = first_tensor(s)
    widths = list(s.arg(1, "pad")[0])
    ids = align(xl.ids, x.dim())
    dims = [x.dim() - 1 - k // 2 for k in range(len(widths))]
    apart = [d for d in dims if ids.shape[d] > 1 or x.shape[d] == 1]
    widths = [w if d in apart else 0 for w, d in zip(widths, dims)]
    ids = expand_dims(ids, x.shape, apart)
    return Label(compact(F.pad(ids, tuple(widths), value=NO_ID)), xl.param)


@register_rule(torch.roll, torch.flip, torch.repeat_interleave, "roll", "flip", "repeat", "repeat_interleave")
def reorder(s: Step) -> Any:
    """Shifts and flips move positions, repeats copy them (grouped-query attention's key/value heads): run
    them on ids expanded along every dim."""
    x, xl = first_tensor(s)
    ids = expand_dims(align(xl.ids, x.dim()), x.shape, range(x.dim()))
    fn = getattr(ids, s.node.target) if s.node.op == "call_method" else (lambda *a, **k: s.node.target(ids, *a, **k))
    return Label(compact(fn(*s.args[1:], **s.kwargs)), xl.param)


@RULES.constants(torch.repeat_interleave, "repeat_interleave", "repeat")
def repeat_constants(site: Site) -> list[ConstantSpec]:
    """A repeat that makes the unit axis from a size-1 dim of its input (one key/value head copied to every query
    head) holds the count: its number of copies there. A repeat of a dim that holds the units already keeps its
    number of copies per unit, whatever the count."""
    if site.out_dim is None or site.in_dim is not None:
        return []
    path = _repeats_path(site)
    shift = len(site.out_shape) - len(site.in_shape)  # ``repeat`` may add leading dims
    if path is None or (site.out_dim >= shift and site.in_shape[site.out_dim - shift] != 1):
        raise Unsupported(f"{site.node.name}: makes the unit axis by a repeat that no count rewrites")
    return [site.constant(path, site.out_shape[site.out_dim])]


def _repeats_path(site: Site) -> Path | None:
    """Where ``site``'s repeat holds its number of copies along the unit axis: ``repeat_interleave``'s ``repeats``
    (along the dim it names), ``repeat``'s entry for that dim; None where no argument holds it alone."""
    node = site.node
    if node.target == "repeat":
        paths = shape_paths(node, 1)
        return paths[site.out_dim] if len(paths) == len(site.out_shape) else None
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
    if not isinstance(dim, int) or dim % len(site.out_shape) != site.out_dim:
        return None
    return ("args", 1) if len(node.args) > 1 else ("kwargs", "repeats")


@register_rule("unfold")
def windows(s: Step) -> Label:
    """``x.unfold(dim, size, step)``: overlapping windows along ``dim`` (a new last dim of window positions):
    run it on ids expanded along ``dim``."""
    x, xl = first_tensor(s)
    d = wrap_dim(s.arg(1, "dimension")[0], x.dim())
    ids = expand_dims(align(xl.ids, x.dim()), x.shape, [d])
    return Label(compact(ids.unfold(d, s.arg(2, "size")[0], s.arg(3, "step")[0])), xl.param)


@register_rule(F.unfold, nn.Unfold)
def unfold(s: Step) -> Label | None:
    """Sliding blocks ``[N, C, *space] -> [N, C * prod(kernel), blocks]``: channel c becomes the rows of its
    kernel positions, ``c * K .. (c + 1) * K - 1``; positions within a channel are one coordinate."""
    x, xl = first_tensor(s)
    if xl is None:
        return None
    if s.node.op == "call_module":
        kernel = s.lab.module.get_submodule(s.node.target).kernel_size
    else:
        kernel = s.arg(1, "kernel_size")[0]
    per_channel = s.out.shape[1] // x.shape[1] if x.shape[1] else math.prod(
        kernel if isinstance(kernel, (tuple, list)) else [kernel] * (x.dim() - 2))
    channels, tie = fold(align(xl.ids, x.dim()), list(range(2, x.dim())))
    s.rec.tie(tie)
    rows = channels.flatten(1).repeat_interleave(per_channel, dim=1) if channels.shape[1] > 1 else channels.flatten(1)
    return Label(rows.unsqueeze(-1), xl.param)
