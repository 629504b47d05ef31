"""Linear maps (Linear, F.linear, convolutions over all channels) start spaces and read sinks; depthwise
convolutions and pooling keep channels apart."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..constants import ConstantSpec, Site, get_path
from ..ids import align, fold, pairs
from ..labeller import Label, Step
from ..records import NonEmpty, Sink, Space
from .base import RULES, defer_pins, first_tensor, head_axis, mixing_map, param_label, register_rule
from .opaque import fallback


def linear_labels(s: Step, x: torch.Tensor, xl: Label | None, weight: str | None, bias: Any,
                  dim: int = -1, computed: Label | None = None, weight_in_rows: bool = False) -> Label:
    """``y = x Wᵀ + b`` over feature dim ``dim`` (last for a Linear, 1 for a pointwise convolution):
    x's feature coordinates are consumed (W's columns are the sink); y's feature dim is a new space
    of coordinates, W's rows and b's entries belong to them. A weight ``computed`` from a parameter (a
    chunk of a packed one) lends its rows to the space but cannot be the sink. ``weight_in_rows``: W is
    stored [in, out] (``y = x W + b``, GPT-2's Conv1D), so its rows are read and its columns are the space. A map
    over a heads axis mixes the heads instead (``_over_heads``)."""
    if xl is not None and not xl.param and weight is not None:
        mixed = _over_heads(s, x, xl, weight, bias, dim, weight_in_rows)
        if mixed is not None:
            return mixed
    w_rank = 2 if weight is None else _state(s, weight).dim()
    kernel = (1,) * (w_rank - 2)
    reads, writes = ((-1, 1, *kernel), (1, -1, *kernel)) if weight_in_rows else ((1, -1, *kernel), (-1, 1, *kernel))
    if xl is not None:
        xi = align(xl.ids, x.dim())
        if xl.param or weight is None:
            s.rec.pin(xl.ids, f"{s.name}: linear map of a parameter or by a computed weight")
        else:
            lead = [d for d in range(x.dim()) if d != dim % x.dim()]
            col, tie = fold(xi, lead)
            s.rec.tie(tie)
            col = col.reshape(reads)
            s.rec.member(weight, col)
            source = None if s.lab.nested else s.node_of(x)
            s.rec.sinks.append(Sink(weight, s.name, col.flatten(), dim, 0 if weight_in_rows else 1,
                                    None if source is None else source.name))
    d_out = dim % s.out.dim()
    n_out = s.out.shape[d_out]
    space = s.rec.fresh((n_out,))
    s.rec.spaces.append(Space(int(space[0]) if n_out else s.rec.next_id, s.rec.next_id, s.name))
    if weight is not None:
        s.rec.member(weight, space.reshape(writes))
    elif computed is not None and computed.param:
        s.rec.tentative.append(pairs(align(computed.ids, 2), space.reshape(n_out, 1)))
    bias_val, bias_lab, bias_name = bias
    if bias_name is not None:
        s.rec.member(bias_name, space)
    elif bias_lab is not None and bias_lab.param:
        s.rec.tentative.append(pairs(bias_lab.ids, space))
    elif torch.is_tensor(bias_val):
        defer_pins(s, space, tuple(bias_val.shape), "a computed bias")
    return Label(align(space.reshape(n_out, *(1,) * (s.out.dim() - d_out - 1)), s.out.dim()))


def _over_heads(s: Step, x: torch.Tensor, xl: Label, weight: str, bias: Any, dim: int,
                weight_in_rows: bool) -> Label | None:
    """A heads×heads map over a heads axis (timm's talking heads: ``proj_l(attn.permute(0, 2, 3, 1))``) mixes the
    heads (``base.mixing_map``): its output carries the input's ids, and its bias belongs to the heads it makes.
    None where the input is no heads axis, or the map is not heads×heads with a bias of its own (or none)."""
    d = dim % x.dim()
    bias_val, _, bias_name = bias
    if tuple(_state(s, weight).shape) != (x.shape[d],) * 2 or (torch.is_tensor(bias_val) and bias_name is None):
        return None
    heads = head_axis(s, align(xl.ids, x.dim()), d)
    if heads is None:
        return None
    read, made = (0, 1) if weight_in_rows else (1, 0)
    mixing_map(s, weight, heads, read=read, made=made, source=s.node_of(x), dim=d)
    if bias_name is not None:
        s.rec.member(bias_name, heads)
    return Label(xl.ids)


def _state(s: Step, name: str) -> torch.Tensor:
    owner, _, attr = name.rpartition(".")
    return getattr(s.lab.module.get_submodule(owner), attr)


def _reads_inputs(s: Step, i: int, key: str) -> bool:
    """Whether argument ``i`` (or ``key``) of the node depends on the graph's inputs (not on sizes and constants
    alone)."""
    raw = s.node.args[i] if i < len(s.node.args) else s.node.kwargs.get(key)
    return raw in s.lab.dynamic


def _is_state(s: Step, node: Any) -> bool:
    """A graph read of a parameter or buffer of the module (what surgery can slice), not of a plain attribute."""
    if getattr(node, "op", None) != "get_attr":
        return False
    owner, _, name = node.target.rpartition(".")
    module = s.lab.module.get_submodule(owner)
    state = (*module.named_parameters(recurse=False, remove_duplicate=False),
             *module.named_buffers(recurse=False, remove_duplicate=False))
    return any(name == own for own, _ in state)


@register_rule(nn.Linear, always=True)
def linear_module(s: Step) -> Label:
    x, xl = first_tensor(s)
    mod = s.lab.module.get_submodule(s.node.target)
    bias = (mod.bias, None, f"{s.node.target}.bias" if mod.bias is not None else None)
    return linear_labels(s, x, xl, f"{s.node.target}.weight", bias)


@register_rule(F.linear, always=True)
def linear_function(s: Step) -> Label:
    x, xl = s.arg(0, "input")
    raw_w = s.node.args[1] if len(s.node.args) > 1 else s.node.kwargs.get("weight")
    weight = raw_w.target if _is_state(s, raw_w) else None
    bval, blab = s.arg(2, "bias")
    raw_b = s.node.args[2] if len(s.node.args) > 2 else s.node.kwargs.get("bias")
    bname = raw_b.target if getattr(raw_b, "op", None) == "get_attr" else None
    return linear_labels(s, x, xl, weight, (bval, blab, bname), computed=s.arg(1, "weight")[1])


@register_rule(torch.addmm, always=True)
def addmm(s: Step) -> Label:
    """``bias + x @ W`` with W a parameter stored [in, out]: a linear map whose weight rows are its inputs."""
    (bval, blab), (x, xl) = s.arg(0, "input"), s.arg(1, "mat1")
    raw_b, raw_w = s.node.args[0], s.node.args[2] if len(s.node.args) > 2 else s.node.kwargs.get("mat2")
    scaled = s.arg(3, "beta", 1)[0] != 1 or s.arg(4, "alpha", 1)[0] != 1
    weight = raw_w.target if _is_state(s, raw_w) and not scaled else None
    bname = raw_b.target if getattr(raw_b, "op", None) == "get_attr" else None
    if weight is None:  # a product of activations, or a scaled one: no linear map of a parameter
        return fallback(s)
    return linear_labels(s, x, xl, weight, (bval, blab, bname), weight_in_rows=True)


_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
_CONV_FUNCS = (F.conv1d, F.conv2d, F.conv3d)
_TRANSPOSED_FUNCS = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)


@register_rule(*_CONVS, always=True)
def conv_module(s: Step) -> Label | None:
    mod = s.lab.module.get_submodule(s.node.target)
    bias = (mod.bias, None, f"{s.node.target}.bias" if mod.bias is not None else None)
    return conv_labels(s, f"{s.node.target}.weight", mod.weight, bias, mod.groups, transposed=mod.transposed)


@register_rule(*_CONV_FUNCS, *_TRANSPOSED_FUNCS, always=True)
def conv_function(s: Step) -> Label | None:
    raw_w = s.node.args[1] if len(s.node.args) > 1 else s.node.kwargs.get("weight")
    if not _is_state(s, raw_w):  # a computed kernel (or a plain attribute): nothing to slice
        return fallback(s)
    bval, blab = s.arg(2, "bias")
    raw_b = s.node.args[2] if len(s.node.args) > 2 else s.node.kwargs.get("bias")
    bname = raw_b.target if getattr(raw_b, "op", None) == "get_attr" else None
    return conv_labels(s, raw_w.target, s.arg(1, "weight")[0], (bval, blab, bname), s.arg(6, "groups", 1)[0],
                       transposed=s.node.target in _TRANSPOSED_FUNCS)


@RULES.constants(*_CONV_FUNCS, *_TRANSPOSED_FUNCS)
def conv_constants(site: Site) -> list[ConstantSpec]:
    """A grouped (depthwise) convolution over the unit axis in a captured graph: its ``groups`` literal is the
    channel count, so it follows the units (a module reads its own ``groups``, which follows them)."""
    n = site.node
    if site.in_dim is None or site.in_dim % len(site.in_shape) != 1:
        return []
    if len(n.args) > 6:
        path = ("args", 6)
    elif "groups" in n.kwargs:
        path = ("kwargs", "groups")
    else:
        return []  # one group: nothing follows the count
    return [] if get_path(n, path) == 1 else [site.constant(path, site.in_shape[1])]


def conv_labels(s: Step, weight: str, w: torch.Tensor, bias: Any, groups: int,
                transposed: bool = False) -> Label | None:
    """A convolution over all channels is a Linear over channels (dim 1) at each kernel offset: an input
    channel is read by its slice of the weight's dim 1, an output channel made by its rows and bias (spatial
    positions mix, as tokens do not in a Linear, but a channel's coordinates stay its own). A depthwise one
    keeps channels apart (with a channel multiplier, output channel o reads input channel o // multiplier);
    any other grouping has no rule. A ``transposed`` convolution is the same map with its weight stored
    [in, out / groups, kernel]: its dim 0 reads, its dim 1 makes."""
    x, xl = first_tensor(s)
    if transposed:
        in_channels, out_channels = w.shape[0], w.shape[1] * groups
    else:
        out_channels, in_channels = w.shape[0], w.shape[1] * groups
    if groups == 1:
        out = linear_labels(s, x, xl, weight, bias, dim=1, weight_in_rows=transposed)
    elif xl is None:
        return None
    elif groups == in_channels and out_channels % in_channels == 0:
        out = depthwise_labels(s, x, xl, [(weight, w), (bias[2], bias[0])], multiplier=out_channels // in_channels,
                               out_channels=out_channels)
    else:
        return fallback(s)
    for lab in (xl, out):
        if lab is not None:
            s.rec.nonempty.append(NonEmpty(lab.ids, f"{s.name}: a convolution cannot have zero channels"))
    return out


def depthwise_labels(s: Step, x: torch.Tensor, xl: Label, params: list[tuple[str | None, Any]],
                     multiplier: int = 1, out_channels: int = 0) -> Label:
    """Channel c of the output reads channel c of the input only (channels ``multiplier``·c to
    ``multiplier``·c + ``multiplier`` - 1 with a channel multiplier): channel ids pass through (space is tied
    within a channel; batch items stay apart, heads folded into the batch too), and every element of the
    per-channel ``params`` joins its channel (unless heads share it): their elements in ``out_channels`` rows (the
    first dim's size if not given)."""
    ch, tie = fold(align(xl.ids, x.dim()), list(range(2, x.dim())))
    s.rec.tie(tie)
    if ch.shape[1] > 1:
        ch = ch.repeat_interleave(multiplier, dim=1)
    per_channel = ch.reshape(ch.shape[0], ch.shape[1], 1)
    for name, p in params:  # a transposed kernel [in, multiplier, ...] holds the output channels in its first 2 dims
        if name is not None:
            ids = param_label(s, name, p).ids.reshape(1, out_channels or p.shape[0], -1)
            s.rec.tentative.append(pairs(ids, per_channel))
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


@register_rule(*_POOL_MODULES, nn.Upsample, *_POOL_FUNCS, F.interpolate)
def pool(s: Step) -> Label | None:
    """Pooling and resampling over space keep channels (dim 1) apart, like a depthwise convolution without
    weights (a position embedding resized to another grid keeps its channels). A max pool's indices too are per
    channel: they carry the values' labels."""
    x, xl = first_tensor(s)
    pair = isinstance(s.out, tuple) and len(s.out) == 2 and all(torch.is_tensor(o) for o in s.out) \
        and s.out[0].shape == s.out[1].shape
    if not (torch.is_tensor(s.out) or pair) or x.dim() < 3:  # an unbatched input
        return fallback(s)
    label = depthwise_labels(s, x, xl, [])
    return (label, label) if pair else label


@register_rule(nn.Embedding, F.embedding, always=True)
def embedding(s: Step) -> Label | None:
    """A lookup of rows, ``one_hot(indices) @ W``: a linear map from the table's rows, so the looked-up features
    (W's columns) are a new space and W is its member along dim 1. Indices that carry ids, a computed table, or
    one renormalised in place (``max_norm``) are read as no such map. Indices made from sizes and constants alone
    (positions, ``arange(n)``) look up a value of the table alone: a parameter's label, which joins the classes it
    meets one per use and stays out where one use meets several (a position table beside every head)."""
    if s.node.op == "call_module":
        mod = s.lab.module.get_submodule(s.node.target)
        index_label, table, max_norm = first_tensor(s)[1], f"{s.node.target}.weight", mod.max_norm
    else:
        index_label = s.arg(0, "input")[1]
        raw_table = s.node.args[1] if len(s.node.args) > 1 else s.node.kwargs.get("weight")
        table, max_norm = raw_table.target if _is_state(s, raw_table) else None, s.arg(3, "max_norm")[0]
    if index_label is not None or table is None or max_norm is not None:
        return fallback(s)
    n_out = s.out.shape[-1]
    space = s.rec.fresh((n_out,))
    s.rec.spaces.append(Space(int(space[0]) if n_out else s.rec.next_id, s.rec.next_id, s.name))
    s.rec.member(table, space.reshape(1, n_out))
    return Label(align(space, s.out.dim()), param=not _reads_inputs(s, 0, "input"))
