"""The op table of the labelling: one small rule per op family.

A rule gets a ``Step`` (real argument values, their labels, the real output) and returns the output's
``Label`` (or a tuple of them), recording ties, pins and mixes on the way. Anything that receives ids
and has no rule pins them: the analysis never guesses.
"""
from __future__ import annotations

import inspect
import operator
import os
import string
from typing import Any, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import ids as I
from .errors import TraceError
from .labelling import Label, Labeller, RuleTable, Step, always
from .tracing import pack, pytree_info, trace_function

RULES = RuleTable()
NO_ID = I.NO_ID


# ---------------------------------------------------------------- helpers

def _first(s: Step) -> tuple[torch.Tensor, Label | None]:
    return next(iter(s.tensors()))


def _dim(d: int, ndim: int) -> int:
    return d % ndim if ndim else 0


def _pin_all(s: Step, reason: str, benign: bool = False) -> None:
    for _, lab in s.tensors():
        if lab is not None:
            s.rec.pin(lab.ids, f"{s.name}: {reason}", benign)


def _defer_pins(s: Step, ids: torch.Tensor, other: Sequence[int], what: str, benign: bool = True) -> None:
    """A tensor we cannot slice lines up with ``ids``: fine unless the unit axis is one of those dims (then
    the axis is no unit axis, or, with ``benign`` False, its units are refused)."""
    ids = I.align(ids, max(ids.dim(), len(other)))
    other = (1,) * (ids.dim() - len(other)) + tuple(other)
    for d in range(ids.dim()):
        if ids.shape[d] > 1 and other[d] > 1:
            s.rec.pin(ids, f"{s.name}: {what} lines up with the unit axis (dim {d})", benign, d)


def elementwise_labels(s: Step, operands: list[tuple[Any, Label | None]], ndim: int) -> Label | None:
    """Output label of an elementwise op over tensor ``operands`` broadcast to rank ``ndim``."""
    acts = [I.align(l.ids, ndim) for v, l in operands if l is not None and not l.param]
    params = [I.align(l.ids, ndim) for v, l in operands if l is not None and l.param]
    plain = [tuple(v.shape) for v, l in operands if l is None and torch.is_tensor(v)]
    if not acts:
        if plain and any(any(n > 1 for n in sh) for sh in plain):
            for p in params:  # a parameter combined with an unsliceable activation
                s.rec.pin(p, f"{s.name}: parameter combined with a plain activation", True)
            return None
        ids = params[0]
        for p in params[1:]:
            ids, tie = I.merge(ids, p)
            s.rec.tie(tie)
        return Label(ids, True)
    ids = acts[0]
    for a in acts[1:]:
        ids, tie = I.merge(ids, a)
        s.rec.tie(tie)
    for p in params:
        s.rec.tentative.append(I.pairs(p, ids))
    for sh in plain:
        _defer_pins(s, ids, sh, "a plain tensor")
    return Label(ids)


def mix(s: Step, ids: torch.Tensor, dims: Sequence[int], what: str) -> None:
    """Coordinates normalised or reduced together: removing one changes the others (not exact)."""
    dims = [d for d in dims if ids.shape[d] > 1]
    if dims:
        rep = ids.amax(dim=dims, keepdim=True)
        a, b = I.broadcast(ids, rep)
        p = I.unique_pairs(torch.stack([a.flatten(), b.flatten()], 1))
        s.rec.mixes.append((p, f"{s.name}: {what}"))


# ---------------------------------------------------------------- sources and sinks

def get_attr(s: Step) -> Label | None:
    """Parameters and float buffers get one fresh id per element; integer buffers are indices."""
    if not torch.is_tensor(s.out) or not s.out.is_floating_point():
        return None
    return param_label(s, s.node.target, s.out)


def param_label(s: Step, name: str, p: torch.Tensor) -> Label:
    """Fresh ids, one per element, for a parameter or buffer; it is a member candidate."""
    ids = s.rec.fresh(tuple(p.shape))
    s.rec.member(name, ids)
    return Label(ids, True)


def output(s: Step) -> Any:
    if s.lab.nested:  # the inside of an opaque function hands its labels back to the caller
        return s.largs[0]
    _pin_all(s, "reaches the graph output", benign=True)
    return None


def placeholder(s: Step) -> Any:
    return s.lab.seeds.get(s.node.target) if s.lab.nested else None


RULES.always["get_attr"] = get_attr
RULES.always["output"] = output
RULES.always["placeholder"] = placeholder


def linear_labels(s: Step, x: torch.Tensor, xl: Label | None, weight: str | None, bias: Any,
                  dim: int = -1, computed: Label | None = None) -> Label:
    """``y = x Wᵀ + b`` over feature dim ``dim`` (last for a Linear, 1 for a pointwise convolution):
    x's feature coordinates are consumed (W's columns are the sink); y's feature dim is a new space
    of coordinates, W's rows and b's entries belong to them. A weight ``computed`` from a parameter (a
    chunk of a packed one) lends its rows to the space but cannot be the sink."""
    w_rank = 2 if weight is None else s.lab.module.get_parameter(weight).dim()
    kernel = (1,) * (w_rank - 2)
    if xl is not None:
        xi = I.align(xl.ids, x.dim())
        if xl.param or weight is None:
            s.rec.pin(xl.ids, f"{s.name}: linear map of a parameter or by a computed weight")
        else:
            lead = [d for d in range(x.dim()) if d != dim % x.dim()]
            col, tie = I.fold(xi, lead)
            s.rec.tie(tie)
            col = col.reshape(1, -1, *kernel)
            s.rec.member(weight, col)
            s.rec.sinks.append((weight, s.name, col.flatten(), dim))
    d_out = dim % s.out.dim()
    n_out = s.out.shape[d_out]
    space = s.rec.fresh((n_out,))
    s.rec.spaces.append((int(space[0]) if n_out else s.rec.next_id, s.rec.next_id, s.name))
    if weight is not None:
        s.rec.member(weight, space.reshape(n_out, 1, *kernel))
    elif computed is not None and computed.param:
        s.rec.tentative.append(I.pairs(I.align(computed.ids, 2), space.reshape(n_out, 1)))
    bias_val, bias_lab, bias_name = bias
    if bias_name is not None:
        s.rec.member(bias_name, space)
    elif bias_lab is not None and bias_lab.param:
        s.rec.tentative.append(I.pairs(bias_lab.ids, space))
    elif torch.is_tensor(bias_val):
        _defer_pins(s, space, tuple(bias_val.shape), "a computed bias")
    return Label(I.align(space.reshape(n_out, *(1,) * (s.out.dim() - d_out - 1)), s.out.dim()))


@RULES.module(nn.Linear)
@always
def linear_module(s: Step) -> Label:
    x, xl = _first(s)
    mod = s.lab.module.get_submodule(s.node.target)
    bias = (mod.bias, None, f"{s.node.target}.bias" if mod.bias is not None else None)
    return linear_labels(s, x, xl, f"{s.node.target}.weight", bias)


@RULES.function(F.linear)
@always
def linear_function(s: Step) -> Label:
    x, xl = s.arg(0, "input")
    raw_w = s.node.args[1] if len(s.node.args) > 1 else s.node.kwargs.get("weight")
    weight = raw_w.target if getattr(raw_w, "op", None) == "get_attr" else None
    bval, blab = s.arg(2, "bias")
    raw_b = s.node.args[2] if len(s.node.args) > 2 else s.node.kwargs.get("bias")
    bname = raw_b.target if getattr(raw_b, "op", None) == "get_attr" else None
    return linear_labels(s, x, xl, weight, (bval, blab, bname), computed=s.arg(1, "weight")[1])


_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


@RULES.module(*_CONVS)
@always
def conv_module(s: Step) -> Label | None:
    """A pointwise convolution is a Linear over channels (dim 1); a depthwise one keeps channels
    apart; any other convolution mixes channels with space and has no rule."""
    x, xl = _first(s)
    mod = s.lab.module.get_submodule(s.node.target)
    weight = f"{s.node.target}.weight"
    bias = (mod.bias, None, f"{s.node.target}.bias" if mod.bias is not None else None)
    if mod.groups == 1 and all(k == 1 for k in mod.kernel_size):
        out = linear_labels(s, x, xl, weight, bias, dim=1)
    elif xl is None:
        return None
    elif mod.groups == mod.in_channels == mod.out_channels:
        out = depthwise_labels(s, x, xl, [(weight, mod.weight), (bias[2], mod.bias)])
    else:
        return fallback(s)
    for lab in (xl, out):
        if lab is not None:
            s.rec.nonempty.append((lab.ids, f"{s.name}: a convolution cannot have zero channels"))
    return out


def depthwise_labels(s: Step, x: torch.Tensor, xl: Label, params: list[tuple[str | None, Any]]) -> Label:
    """Channel c of the output reads channel c of the input only: channel ids pass through (space
    is tied within a channel; batch items stay apart, heads folded into the batch too), and every
    element of the per-channel ``params`` joins its channel (unless heads share it)."""
    ch, tie = I.fold(I.align(xl.ids, x.dim()), list(range(2, x.dim())))
    s.rec.tie(tie)
    per_channel = ch.reshape(ch.shape[0], ch.shape[1], 1)
    for name, p in params:
        if name is not None:
            ids = param_label(s, name, p).ids.reshape(1, p.shape[0], -1)
            s.rec.tentative.append(I.pairs(ids, per_channel))
    return Label(ch)


_POOL_MODULES = (
    nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d,
    nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d,
    nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d,
)
_POOL_FUNCS = (
    F.max_pool1d, F.max_pool2d, F.max_pool3d, F.avg_pool1d, F.avg_pool2d, F.avg_pool3d,
    F.adaptive_avg_pool1d, F.adaptive_avg_pool2d, F.adaptive_avg_pool3d,
    F.adaptive_max_pool1d, F.adaptive_max_pool2d, F.adaptive_max_pool3d,
)


@RULES.module(*_POOL_MODULES)
@RULES.function(*_POOL_FUNCS)
def pool(s: Step) -> Label | None:
    """Pooling over space keeps channels (dim 1) apart, like a depthwise convolution without weights."""
    x, xl = _first(s)
    if not torch.is_tensor(s.out) or x.dim() < 3:  # indices returned too, or an unbatched input
        return fallback(s)
    return depthwise_labels(s, x, xl, [])


# ---------------------------------------------------------------- elementwise

_UNARY_FUNCS = [
    torch.relu, F.relu, F.gelu, F.silu, F.elu, F.leaky_relu, F.hardswish, F.hardsigmoid, F.mish,
    F.softplus, F.relu6, torch.sigmoid, torch.tanh, F.dropout, torch.exp, torch.neg, torch.abs,
    torch.sqrt, torch.rsqrt, torch.sin, torch.cos, torch.erf, torch.log, torch.square, torch.clamp,
    torch.clone, torch.detach, torch.zeros_like, torch.ones_like, torch.full_like, torch.empty_like,
    torch.rand_like, torch.randn_like, operator.neg, torch.nan_to_num, F.sigmoid, F.tanh,
]
_BINARY_FUNCS = [
    operator.add, operator.sub, operator.mul, operator.truediv, operator.pow, operator.iadd,
    operator.imul, operator.isub, operator.itruediv, torch.add, torch.sub, torch.mul, torch.div,
    torch.where, torch.maximum, torch.minimum, torch.pow, torch.lerp, torch.addcmul,
]
_ELEMENTWISE_METHODS = [
    "relu", "sigmoid", "tanh", "exp", "neg", "abs", "sqrt", "rsqrt", "sin", "cos", "erf", "log",
    "square", "clamp", "clip", "pow", "add", "sub", "mul", "div", "masked_fill", "where", "lerp",
    "zero", "fill", "nan_to_num", "softplus", "addcmul", "maximum", "minimum",
]
_PASSTHROUGH_METHODS = [
    "contiguous", "clone", "detach", "float", "double", "half", "bfloat16", "to", "type", "type_as",
    "requires_grad_", "cpu", "cuda",
]
_ELEMENTWISE_MODULES = (
    nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.AlphaDropout, nn.Identity, nn.GELU, nn.ReLU, nn.ReLU6,
    nn.SiLU, nn.Sigmoid, nn.Tanh, nn.Hardswish, nn.Hardsigmoid, nn.LeakyReLU, nn.ELU, nn.Mish,
    nn.Softplus,
)


@RULES.function(*_UNARY_FUNCS, *_BINARY_FUNCS)
@RULES.method(*_ELEMENTWISE_METHODS)
def elementwise(s: Step) -> Label | None:
    if not torch.is_tensor(s.out):
        return None
    return elementwise_labels(s, list(s.tensors()), s.out.dim())


@RULES.method(*_PASSTHROUGH_METHODS)
def passthrough(s: Step) -> Label | None:
    """Copies and dtype/device moves: the first tensor's ids (later tensor arguments only give a dtype)."""
    x, xl = _first(s)
    return xl if torch.is_tensor(s.out) else None


@RULES.module(*_ELEMENTWISE_MODULES)
def elementwise_module(s: Step) -> Label | None:
    return elementwise(s)


# ---------------------------------------------------------------- views and layout

@RULES.function(torch.reshape, torch.flatten, torch.squeeze, torch.unsqueeze, torch.unflatten)
@RULES.method("view", "reshape", "flatten", "unflatten", "squeeze", "unsqueeze", "view_as", "reshape_as")
@RULES.module(nn.Flatten)  # no sizes of its own (nn.Unflatten holds one: no rule, so it is refused)
def reshape(s: Step) -> Label | None:
    x, xl = _first(s)
    if xl is None:  # only the shape source (view_as / reshape_as) carries ids
        return None
    ids = I.align(xl.ids, x.dim())
    return Label(I.compact(I.reshape(ids, x.shape, s.out.shape)), xl.param)


@RULES.function(torch.permute, torch.transpose, torch.movedim, torch.swapaxes, torch.t)
@RULES.method("permute", "transpose", "movedim", "swapaxes", "t", "swapdims")
def move_dims(s: Step) -> Label:
    """Dim moves act on ids exactly as on the value."""
    x, xl = _first(s)
    ids = I.align(xl.ids, x.dim())
    rest_args = s.args[1:]
    if s.node.op == "call_method":
        out = getattr(ids, s.node.target)(*rest_args, **s.kwargs)
    else:
        out = s.node.target(ids, *rest_args, **s.kwargs)
    return Label(out, xl.param)


@RULES.method("expand", "expand_as", "broadcast_to")
@RULES.function(torch.broadcast_to)
def expand(s: Step) -> Label:
    x, xl = _first(s)
    return Label(I.align(xl.ids, s.out.dim()), xl.param)


def _slice_like(s: Step, dim: int) -> Any:
    """Ops that pick parts along one dim (split, chunk, unbind, narrow, select): run them on ids
    expanded along that dim."""
    x, xl = _first(s)
    ids = I.align(xl.ids, x.dim())
    d = _dim(dim, x.dim())
    ids = I.expand_dims(ids, x.shape, [d])
    fn = getattr(ids, s.node.target) if s.node.op == "call_method" else (lambda *a, **k: s.node.target(ids, *a, **k))
    res = fn(*s.args[1:], **s.kwargs)
    if isinstance(res, (tuple, list)):
        return tuple(Label(I.compact(r), xl.param) for r in res)
    return Label(I.compact(res), xl.param)


@RULES.function(torch.split, torch.chunk, torch.tensor_split)
@RULES.method("split", "chunk", "tensor_split")
def split(s: Step) -> Any:
    dim = s.arg(2, "dim", 0)[0]
    return _slice_like(s, dim)


@RULES.function(torch.unbind)
@RULES.method("unbind")
def unbind(s: Step) -> Any:
    return _slice_like(s, s.arg(1, "dim", 0)[0])


@RULES.function(torch.narrow, torch.select, torch.index_select)
@RULES.method("narrow", "select", "index_select")
def narrow(s: Step) -> Any:
    return _slice_like(s, s.arg(1, "dim", 0)[0])


def index_dims(index: Any, ndim: int) -> list[tuple[int | None, Any]]:
    """Pair each entry of a ``__getitem__`` index with the input dim it applies to (None: new axis)."""
    if not isinstance(index, tuple):
        index = (index,)
    used = sum(1 for e in index if e is not None and e is not Ellipsis and not (torch.is_tensor(e) and e.dtype == torch.bool))
    used += sum(e.dim() for e in index if torch.is_tensor(e) and e.dtype == torch.bool)
    out, d = [], 0
    for e in index:
        if e is Ellipsis:
            d += ndim - used
        elif e is None:
            out.append((None, e))
        elif torch.is_tensor(e) and e.dtype == torch.bool:
            out.append((d, e))
            d += e.dim()
        else:
            out.append((d, e))
            d += 1
    return out


@RULES.function(operator.getitem)
@always
def getitem(s: Step) -> Any:
    src, idx = s.args[0], s.args[1]
    if s.node.args[0] in s.rec.size_reads:
        s.rec.size_reads.add(s.node)
    if isinstance(s.largs[0], tuple):  # an element of a multi-output op
        return s.largs[0][idx]
    if not torch.is_tensor(src) or s.largs[0] is None:
        return None
    xl: Label = s.largs[0]
    if s.node.args[1] is not None and isinstance(s.node.args[1], torch.fx.Node) and s.lab.labels.get(s.node.args[1]) is not None:
        _pin_all(s, "indexing by a labelled tensor")
        return None
    ids = I.align(xl.ids, src.dim())
    pairs = index_dims(idx, src.dim())
    touched = [d for d, e in pairs if d is not None and not (isinstance(e, slice) and e == slice(None))]
    ids = I.expand_dims(ids, src.shape, touched)
    res = ids[idx]
    if tuple(res.shape) != tuple(s.out.shape) and res.dim() != s.out.dim():
        _pin_all(s, "index pattern not understood")
        return None
    return Label(I.compact(res), xl.param)


@RULES.function(operator.setitem)
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
    ids = I.align(tl.ids, target.dim())
    entries = index_dims(index, target.dim())
    touched = [d for d, e in entries if d is not None and ids.shape[d] == 1 and not isinstance(e, slice)]
    ids = I.expand_dims(ids, target.shape, touched)
    compact_index = tuple(slice(None) if d is not None and isinstance(e, slice) and ids.shape[d] == 1 else e
                          for d, e in entries)
    region = ids[compact_index]
    s.rec.tie(I.pairs(region, I.align(vl.ids, region.dim())))
    return None


@RULES.function(pack)
def packed(s: Step) -> Any:
    """An inlined helper's returned structure: the labels of its parts."""
    lab = s.largs[0]
    return tuple(lab) if isinstance(lab, list) else lab


@RULES.function(torch.cat, torch.concat, torch.stack)
def cat(s: Step) -> Label | None:
    tensors, dim = s.args[0], s.arg(1, "dim", 0)[0]
    labels = s.largs[0]
    stack = s.node.target is torch.stack
    nd = s.out.dim()
    d = _dim(dim, nd)
    pieces, plain_shapes = [], []
    for v, lab in zip(tensors, labels):
        shape = list(v.shape)
        if stack:
            shape.insert(d, 1)
        if isinstance(lab, Label):
            ids = I.align(lab.ids, v.dim())
            ids = ids.unsqueeze(d) if stack else ids
            pieces.append((ids, lab.param, shape))
        else:
            pieces.append((None, None, shape))
            plain_shapes.append(shape)
    labelled = [p for p in pieces if p[0] is not None]
    if all(p[1] for p in labelled) and plain_shapes:
        for ids, _, _ in labelled:
            s.rec.pin(ids, f"{s.name}: parameter concatenated with a plain activation", True)
        return None
    others = [max([p[0].shape[k] for p in labelled] + [1]) if k != d else None for k in range(nd)]
    parts = []
    for ids, _, shape in pieces:
        target = [shape[k] if k == d else others[k] for k in range(nd)]
        if ids is None:
            parts.append(torch.full(target, NO_ID, dtype=torch.long))
        else:
            parts.append(ids.expand(target))
    out = I.compact(torch.cat(parts, dim=d))
    for shape in plain_shapes:
        _defer_pins(s, out, [1 if k == d else shape[k] for k in range(nd)], "a concatenated plain tensor")
    return Label(out, all(p[1] for p in labelled))


@RULES.function(F.pad)
def pad(s: Step) -> Label:
    """Padding adds positions that carry no unit coordinate."""
    x, xl = _first(s)
    widths = s.arg(1, "pad")[0]
    dims = [x.dim() - 1 - k // 2 for k in range(len(widths))]
    ids = I.expand_dims(I.align(xl.ids, x.dim()), x.shape, dims)
    return Label(I.compact(F.pad(ids, tuple(widths), value=NO_ID)), xl.param)


@RULES.function(torch.roll, torch.flip)
@RULES.method("roll", "flip")
def reorder(s: Step) -> Any:
    """Shifts and flips move positions: run them on ids expanded along the dims they touch."""
    x, xl = _first(s)
    ids = I.expand_dims(I.align(xl.ids, x.dim()), x.shape, range(x.dim()))
    fn = getattr(ids, s.node.target) if s.node.op == "call_method" else (lambda *a, **k: s.node.target(ids, *a, **k))
    return Label(I.compact(fn(*s.args[1:], **s.kwargs)), xl.param)


# ---------------------------------------------------------------- contractions

def contract(s: Step, operands: list[tuple[Sequence[int], Label | None]], subs: list[str], out_sub: str) -> Label | None:
    """Einsum-style contraction on ids. A contracted letter that two activations carry ties all its
    coordinates (q·kᵀ makes a head); against a parameter it is a sink; shared batch letters tie
    positions; against a plain tensor the letter may not be the unit axis."""
    letters = sorted(set("".join(subs)) | set(out_sub))
    pos = {c: i for i, c in enumerate(letters)}
    views = []
    for (shape, lab), sub in zip(operands, subs):
        if lab is None:
            views.append((shape, None, sub, None))
            continue
        ids = I.align(lab.ids, len(sub))
        perm = [sub.index(c) for c in letters if c in sub]
        ids = ids.permute(perm)
        full = [1] * len(letters)
        for c, n in zip([c for c in letters if c in sub], ids.shape):
            full[pos[c]] = n
        views.append((shape, lab, sub, ids.reshape(full)))
    reps = [v[3] for v in views]
    consumed = [set() for _ in views]
    for c in letters:
        if c in out_sub:
            continue
        ax = pos[c]
        holders = [i for i, v in enumerate(views) if c in v[2]]
        labelled = [i for i in holders if views[i][1] is not None and reps[i].shape[ax] > 1]
        if not labelled:
            continue
        acts = [i for i in holders if views[i][1] is not None and not views[i][1].param]
        params = [i for i in holders if views[i][1] is not None and views[i][1].param]
        plain = [i for i in holders if views[i][1] is None and views[i][0][views[i][2].index(c)] > 1]
        if len(acts) >= 2:
            for i in acts:
                s.rec.contracted.append(reps[i])
                reps[i], tie = I.fold(reps[i], [ax])
                s.rec.tie(tie)
        elif len(acts) == 1 and params:
            a = acts[0]
            for p in params:
                s.rec.tentative.append(I.pairs(reps[p], reps[a]))
            if any(I.varies(reps[a], pos[k]) for k in out_sub):
                # units kept on another axis (heads) contract their coordinates against a parameter they
                # share (a relative-position table): each unit's coordinates go together and it stays a unit
                reps[a], tie = I.fold(reps[a], [ax])
                s.rec.tie(tie)
            else:
                consumed[a].add(ax)
        elif len(acts) == 1 and plain:
            s.rec.pin(reps[acts[0]], f"{s.name}: contracted against a plain tensor", False, ax)
            consumed[acts[0]].add(ax)
        elif len(acts) == 1:
            mix(s, reps[acts[0]], [ax], "sum over a unit axis")
            consumed[acts[0]].add(ax)
        else:
            s.rec.pin(reps[labelled[0]], f"{s.name}: contraction of parameters")
            return None
    out = None
    for i, v in enumerate(views):
        if v[1] is None or v[1].param:
            continue
        r = reps[i]
        for c in letters:
            if c in out_sub:
                continue
            ax = pos[c]
            if ax in consumed[i] and r.shape[ax] > 1:
                r = torch.full_like(r.narrow(ax, 0, 1), NO_ID)
            elif r.shape[ax] > 1:
                r = r.amax(dim=ax, keepdim=True)
        if out is None:
            out = r
        else:
            out, tie = I.merge(out, r)
            s.rec.tie(tie)
    if out is None:
        return None
    for shape, lab, sub, _ in views:
        if lab is None:
            full = [1] * len(letters)
            for c, n in zip(sub, shape):
                if c in out_sub:
                    full[pos[c]] = n
            _defer_pins(s, out, full, "a plain operand", benign=False)
    out = out.permute([pos[c] for c in out_sub] + [pos[c] for c in letters if c not in out_sub])
    out = out.reshape(out.shape[: len(out_sub)])
    if (out == NO_ID).all():
        return None
    return Label(I.compact(out))


_BATCH = string.ascii_lowercase[:20]


def matmul_subs(ra: int, rb: int) -> tuple[str, str, str]:
    """Einsum subscripts of ``a @ b`` for operand ranks ``ra`` and ``rb`` (batch dims broadcast)."""
    n, k, m = "xyz"
    nb = max(ra, rb) - 2
    batch = _BATCH[:max(nb, 0)]
    a = (batch[len(batch) - (ra - 2):] if ra > 2 else "") + (n + k if ra >= 2 else k)
    b = (batch[len(batch) - (rb - 2):] if rb > 2 else "") + (k + m if rb >= 2 else k)
    out = batch + (n if ra >= 2 else "") + (m if rb >= 2 else "")
    return a, b, out


@RULES.function(torch.matmul, operator.matmul, torch.bmm, torch.mm)
@RULES.method("matmul", "bmm", "mm")
def matmul(s: Step) -> Label | None:
    (a, la), (b, lb) = list(s.tensors())[:2]
    sa, sb, so = matmul_subs(a.dim(), b.dim())
    return contract(s, [(a.shape, la), (b.shape, lb)], [sa, sb], so)


def parse_einsum(eq: str, ranks: Sequence[int]) -> tuple[list[str], str]:
    eq = eq.replace(" ", "")
    lhs, _, rhs = eq.partition("->")
    subs = lhs.split(",")
    spare = iter(c for c in string.ascii_uppercase if c not in eq)
    ell = ""
    if "..." in eq:
        n_ell = max(r - (len(sub) - 3) for r, sub in zip(ranks, subs) if "..." in sub)
        ell = "".join(next(spare) for _ in range(n_ell))
        subs = [sub.replace("...", ell[len(ell) - (r - (len(sub) - 3)):]) if "..." in sub else sub for sub, r in zip(subs, ranks)]
    if not _:
        counts = {c: "".join(subs).count(c) for c in set("".join(subs))}
        rhs = ell + "".join(sorted(c for c, k in counts.items() if k == 1 and c not in ell))
    else:
        rhs = rhs.replace("...", ell)
    return subs, rhs


@RULES.function(torch.einsum)
def einsum(s: Step) -> Label | None:
    eq = s.args[0]
    ops = list(s.tensors())
    subs, out_sub = parse_einsum(eq, [v.dim() for v, _ in ops])
    return contract(s, [(v.shape, l) for v, l in ops], subs, out_sub)


@RULES.function(F.scaled_dot_product_attention)
def sdpa(s: Step) -> Label | None:
    (q, lq), (k, lk), (v, lv) = s.arg(0, "query"), s.arg(1, "key"), s.arg(2, "value")
    mask, lmask = s.arg(3, "attn_mask")
    if q.dim() != k.dim() or k.shape[:-3] != q.shape[:-3] or q.shape[-3:-2] != k.shape[-3:-2]:
        _pin_all(s, "attention with a different number of query and key heads has no rule yet")
        return None
    nb = q.dim() - 2
    batch = _BATCH[:nb]
    scores_shape = tuple(q.shape[:-1]) + (k.shape[-2],)
    scores = contract(s, [(q.shape, lq), (k.shape, lk)], [batch + "le", batch + "se"], batch + "ls")
    if torch.is_tensor(mask):
        ops = [(torch.empty(scores_shape, device="meta"), scores), (mask, lmask)]
        scores = elementwise_labels(s, [(o, l) for o, l in ops], len(scores_shape)) if scores or lmask else None
    if scores is not None:
        mix(s, I.align(scores.ids, len(scores_shape)), [len(scores_shape) - 1], "softmax over keys")
    return contract(s, [(scores_shape, scores), (v.shape, lv)], [batch + "ls", batch + "sv"], batch + "lv")


# ---------------------------------------------------------------- normalisations and reductions

def _normalise(s: Step, x: torch.Tensor, xl: Label | None, dims: Sequence[int], what: str, affine: Sequence[Any] = ()) -> Label | None:
    if xl is not None:
        mix(s, I.align(xl.ids, x.dim()), dims, what)
    operands = [(x, xl)] + [a for a in affine if a is not None]
    return elementwise_labels(s, operands, x.dim())


@RULES.function(F.softmax, torch.softmax, F.log_softmax, torch.log_softmax)
@RULES.method("softmax", "log_softmax")
def softmax(s: Step) -> Label:
    x, xl = _first(s)
    d = s.arg(1, "dim")[0]
    return _normalise(s, x, xl, [_dim(d, x.dim())], "softmax")


@RULES.module(nn.Softmax)
def softmax_module(s: Step) -> Label:
    x, xl = _first(s)
    mod = s.lab.module.get_submodule(s.node.target)
    return _normalise(s, x, xl, [_dim(mod.dim, x.dim())], "softmax")


@RULES.function(F.layer_norm, F.rms_norm)
def layer_norm(s: Step) -> Label:
    x, xl = s.arg(0, "input")
    shape = s.arg(1, "normalized_shape")[0]
    dims = list(range(x.dim() - len(shape), x.dim()))
    w, b = s.arg(2, "weight"), s.arg(3, "bias") if s.node.target is F.layer_norm else (None, None)
    affine = [a for a in (w, b) if torch.is_tensor(a[0])]
    return _normalise(s, x, xl, dims, "normalisation", affine)


@RULES.module(nn.LayerNorm, nn.RMSNorm)
def layer_norm_module(s: Step) -> Label:
    x, xl = _first(s)
    mod = s.lab.module.get_submodule(s.node.target)
    dims = list(range(x.dim() - len(mod.normalized_shape), x.dim()))
    affine = []
    for pname in ("weight", "bias"):
        p = getattr(mod, pname, None)
        if p is not None:
            affine.append((p, param_label(s, f"{s.node.target}.{pname}", p)))
    return _normalise(s, x, xl, dims, "normalisation", affine)


@RULES.module(nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
def batch_norm_module(s: Step) -> Label | None:
    """Statistics are per channel (dim 1): channels stay separate, and the affine weights and running
    statistics are per-channel members."""
    x, xl = _first(s)
    if xl is None:
        return None
    mod = s.lab.module.get_submodule(s.node.target)
    ids = I.align(xl.ids, x.dim())
    mix(s, ids, [d for d in range(x.dim()) if d != 1], "batch normalisation")
    operands = [(x, Label(ids))]
    for pname in ("weight", "bias", "running_mean", "running_var"):
        p = getattr(mod, pname, None)
        if torch.is_tensor(p) and p.is_floating_point():
            per_channel = (-1, *([1] * (x.dim() - 2)))
            pid = param_label(s, f"{s.node.target}.{pname}", p).ids
            operands.append((p.reshape(per_channel), Label(pid.reshape(per_channel), True)))
    return elementwise_labels(s, operands, x.dim())


@RULES.function(F.normalize)
def normalize(s: Step) -> Label:
    x, xl = _first(s)
    d = s.arg(2, "dim", 1)[0]
    return _normalise(s, x, xl, [_dim(d, x.dim())], "normalisation")


@RULES.function(torch.sum, torch.mean, torch.amax, torch.amin, torch.logsumexp, torch.norm, torch.var, torch.std)
@RULES.method("sum", "mean", "amax", "amin", "logsumexp", "norm", "var", "std")
def reduce(s: Step) -> Label | None:
    x, xl = _first(s)
    ids = I.align(xl.ids, x.dim())
    dim = s.arg(2 if s.node.target in ("norm",) or s.node.target is torch.norm else 1, "dim")[0]
    dims = list(range(x.dim())) if dim is None else [_dim(d, x.dim()) for d in (dim if isinstance(dim, (tuple, list)) else [dim])]
    mix(s, ids, dims, "reduction")
    if any(ids.shape[d] > 1 for d in dims):
        return None
    keep = s.out.dim() == x.dim()
    out = ids if keep else ids.reshape([n for k, n in enumerate(ids.shape) if k not in dims])
    return Label(out, xl.param)


# ---------------------------------------------------------------- sizes and the rest

@RULES.function(getattr)
@always
def attribute(s: Step) -> Any:
    if s.args[1] in ("shape",):
        s.rec.size_reads.add(s.node)
    xl = s.largs[0]
    if s.args[1] in ("T", "mT") and torch.is_tensor(s.out) and xl is not None:
        x = s.args[0]
        return Label(I.align(xl.ids, x.dim()).transpose(-2, -1), xl.param)
    return None


@RULES.method("size", "dim", "numel", "__len__")
@always
def size(s: Step) -> None:
    s.rec.size_reads.add(s.node)
    return None


_INLINING: set[Any] = set()  # the functions whose inside is being labelled now (outermost first)


def inline(s: Step) -> Any:
    """A Python function kept opaque in the graph (an autowrapped helper): label its inside."""
    target = s.node.target
    if target in _INLINING:  # its traced inside calls it again (still wrapped): no inside to look at
        raise TraceError(f"{s.name}: {getattr(target, '__name__', target)} traces to a call of itself")
    sig = inspect.signature(target)
    bound = sig.bind(*s.args, **s.kwargs)
    bound.apply_defaults()  # an omitted ``x=None`` is frozen at None, not traced as a tensor
    values = bound.arguments
    labels = sig.bind(*s.largs, **s.lkwargs).arguments
    gm, inputs = trace_function(target, values)
    seeds = {name: labels.get(name) for name, v in values.items() if torch.is_tensor(v)}
    sub = Labeller(gm, RULES, s.rec, seeds)
    _INLINING.add(target)
    try:
        sub.run(*inputs)
    finally:
        _INLINING.discard(target)
    out = sub.labels[next(n for n in gm.graph.nodes if n.op == "output")]
    info = pytree_info(gm.graph)
    return torch.utils._pytree.tree_unflatten(list(out), info.out_spec) if info is not None else out


def fallback(s: Step) -> None:
    """No rule: look inside plain Python functions; otherwise ids that reach this op become
    unsliceable, unless the op returns no tensor."""
    why = "no rule"
    if s.node.op == "call_function" and inspect.isfunction(s.node.target):
        try:
            return inline(s)
        except TraceError as e:
            why = str(e)
    if torch.is_tensor(s.out) or (isinstance(s.out, (tuple, list)) and any(torch.is_tensor(o) for o in s.out)):
        what = s.node.target if s.node.op != "call_module" else type(s.lab.module.get_submodule(s.node.target)).__name__
        name = getattr(what, "__name__", what)
        _pin_all(s, f"no rule for {name}")
        params = [a.target for a in s.node.all_input_nodes if a.op == "get_attr" and _is_param(s.lab.labels.get(a))]
        if params and not s.lab.nested:  # whatever units it holds are invisible: say so
            shared = os.path.commonprefix([p.rpartition(".")[0] + "." for p in params]).rpartition(".")[0]
            shown = ", ".join(p[len(shared) + 1:] if shared else p for p in params)
            s.rec.opaque.append((s.node, f"{s.name}: {name} takes parameters ({shown}) and cannot be looked into "
                                         f"({why}): any units inside it are not analysed"))
    return None


def _is_param(label: Any) -> bool:
    return isinstance(label, Label) and label.param


RULES.fallback = fallback
