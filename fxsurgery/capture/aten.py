"""ATen graphs in torch-level ops, so the concrete-shape capture is read by the same op rules as a symbolic trace.

``torch.export`` records ``aten.<op>.<overload>`` calls. Each becomes the torch function, tensor method or
``torch.nn.functional`` call of the same meaning (same arguments, same result), chosen by a table of small
lowerings; an op with no torch-level twin stays an ATen call, which the rules report as having no rule.
"""
from __future__ import annotations

import operator
from typing import Any, Callable

import torch
import torch.fx
import torch.nn.functional as F

from ..compat import OpOverload, overload_name, rename_node

aten = torch.ops.aten

Call = tuple[str, Any, tuple, dict]  # (fx op, target, args, kwargs)
Lowering = Callable[[tuple, dict, torch.fx.Node], Call]
LOWERINGS: dict[Any, Lowering] = {}

# checks that export inserts and the rules have no use for
DROPPED = {aten._assert_tensor_metadata, aten._assert_scalar, aten.sym_constrain_range_for_size,
           aten._assert_async, aten.sym_constrain_range}


def lowers(*packets: Any) -> Callable[[Lowering], Lowering]:
    def register(fn: Lowering) -> Lowering:
        for p in packets:
            LOWERINGS[p] = fn
        return fn
    return register


def _function(target: Callable[..., Any]) -> Lowering:
    return lambda args, kwargs, node: ("call_function", target, args, kwargs)


def _method(name: str) -> Lowering:
    return lambda args, kwargs, node: ("call_method", name, args, kwargs)


def _opname(node: torch.fx.Node) -> str:
    return node.target.overloadpacket.__name__


def _rank(node: Any) -> int:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else node
    return val.dim() if torch.is_tensor(val) else 0


for _packet, _target in [(aten.linear, F.linear), (aten.conv1d, F.conv1d), (aten.conv2d, F.conv2d),
                         (aten.conv3d, F.conv3d), (aten.scaled_dot_product_attention, F.scaled_dot_product_attention),
                         (aten.gelu, F.gelu), (aten.silu, F.silu), (aten.hardswish, F.hardswish),
                         (aten.mish, F.mish), (aten.elu, F.elu), (aten.leaky_relu, F.leaky_relu),
                         (aten.softplus, F.softplus), (aten.pad, F.pad),
                         (aten.max_pool2d, F.max_pool2d), (aten.avg_pool2d, F.avg_pool2d),
                         (aten.adaptive_avg_pool2d, F.adaptive_avg_pool2d),
                         (aten.adaptive_avg_pool1d, F.adaptive_avg_pool1d),
                         (aten.rms_norm, F.rms_norm)]:
    LOWERINGS[_packet] = _function(_target)
for _name in ("view", "reshape", "expand", "contiguous", "type_as", "expand_as", "view_as", "reshape_as", "repeat"):
    LOWERINGS[getattr(aten, _name)] = _method(_name)
LOWERINGS[aten._unsafe_view] = _method("view")
LOWERINGS[aten.split_with_sizes] = _function(torch.split)
LOWERINGS[aten.im2col] = _function(F.unfold)
LOWERINGS[aten.sym_size] = _method("size")


@lowers(aten.layer_norm, aten.group_norm)
def _norm(args: tuple, kwargs: dict, node: torch.fx.Node) -> Call:
    """layer_norm and group_norm: (input, shape or groups, weight, bias, eps), without ATen's cudnn flag."""
    target = F.layer_norm if node.target.overloadpacket is aten.layer_norm else F.group_norm
    return "call_function", target, args[:5], {}


@lowers(aten.dropout, aten.feature_dropout, aten.alpha_dropout)
def _dropout(args: tuple, kwargs: dict, node: torch.fx.Node) -> Call:
    x, p, train = args
    return "call_function", F.dropout, (x,), {"p": p, "training": train}


@lowers(aten.softmax, aten._softmax, aten.log_softmax, aten._log_softmax)
def _softmax(args: tuple, kwargs: dict, node: torch.fx.Node) -> Call:
    fn = F.log_softmax if "log" in _opname(node) else F.softmax
    dtype = args[2] if len(args) > 2 and not isinstance(args[2], bool) else kwargs.get("dtype")
    return "call_function", fn, (args[0], args[1]), {"dtype": dtype} if dtype is not None else {}


@lowers(aten.upsample_nearest1d, aten.upsample_nearest2d, aten.upsample_nearest3d, aten.upsample_linear1d,
        aten.upsample_bilinear2d, aten.upsample_bicubic2d, aten.upsample_trilinear3d)
def _upsample(args: tuple, kwargs: dict, node: torch.fx.Node) -> Call:
    """``upsample_<mode><n>d.vec``, the op ``F.interpolate`` calls; other overloads stay ATen calls."""
    if overload_name(node.target) != "vec":
        return "call_function", node.target, args, kwargs
    mode = _opname(node).split("_")[1].rstrip("123d")
    x, size, *rest = args
    scales = rest[-1] if rest else None
    options = {"size": size} if size is not None else {"scale_factor": scales}
    if mode != "nearest":
        options["align_corners"] = rest[0]
    return "call_function", F.interpolate, (x,), {**options, "mode": mode}


@lowers(aten.adaptive_max_pool1d, aten.adaptive_max_pool2d, aten.adaptive_max_pool3d)
def _adaptive_max_pool(args: tuple, kwargs: dict, node: torch.fx.Node) -> Call:
    """ATen's adaptive max pooling returns values and indices, read by position: ``F.adaptive_max_pool<n>d`` with
    ``return_indices`` returns the same pair."""
    fn = getattr(F, _opname(node))
    return "call_function", fn, args[:2], {"return_indices": True}


@lowers(aten.unique_consecutive)
def _unique_consecutive(args: tuple, kwargs: dict, node: torch.fx.Node) -> Call:
    """ATen's ``unique_consecutive`` returns values, inverse and counts, read by position, whatever its flags;
    ``torch.unique_consecutive`` returns the three only when asked for all of them (values alone otherwise)."""
    dim = args[3] if len(args) > 3 else kwargs.get("dim")
    return "call_function", torch.unique_consecutive, args[:1], {"return_inverse": True, "return_counts": True,
                                                                 "dim": dim}


@lowers(aten.embedding)
def _embedding(args: tuple, kwargs: dict, node: torch.fx.Node) -> Call:
    weight, indices, *rest = args
    padding_idx = rest[0] if rest and rest[0] != -1 else None
    return "call_function", F.embedding, (indices, weight), {"padding_idx": padding_idx}


@lowers(aten.add, aten.sub)
def _add(args: tuple, kwargs: dict, node: torch.fx.Node) -> Call:
    alpha = kwargs.get("alpha", 1)
    op = operator.add if _opname(node) == "add" else operator.sub
    if alpha != 1:
        return "call_function", getattr(torch, _opname(node)), args, kwargs
    return "call_function", op, args[:2], {}


@lowers(aten.rsub)
def _rsub(args: tuple, kwargs: dict, node: torch.fx.Node) -> Call:
    """``other - x`` (``1. - torch.sigmoid(gate)``), what export records as ``rsub(x, other)``."""
    alpha = args[2] if len(args) > 2 else kwargs.get("alpha", 1)
    if alpha != 1:
        return "call_function", torch.rsub, args, kwargs
    return "call_function", operator.sub, (args[1], args[0]), {}


@lowers(aten.mul)
def _mul(args: tuple, kwargs: dict, node: torch.fx.Node) -> Call:
    return "call_function", operator.mul, args, {}


@lowers(aten.div)
def _div(args: tuple, kwargs: dict, node: torch.fx.Node) -> Call:
    if kwargs.get("rounding_mode") is not None:
        return "call_function", torch.div, args, kwargs
    return "call_function", operator.truediv, args, {}


@lowers(aten.slice)
def _slice(args: tuple, kwargs: dict, node: torch.fx.Node) -> Call:
    """``x[..., start:end:step]`` along one dim."""
    x, dim, start, end, step = (list(args) + [0, None, None, 1][len(args) - 1:])[:5]
    dim %= max(_rank(x), 1)
    return "call_function", operator.getitem, (x, (slice(None),) * dim + (slice(start, end, step),)), {}


@lowers(aten.index)
def _index(args: tuple, kwargs: dict, node: torch.fx.Node) -> Call:
    x, indices = args
    return "call_function", operator.getitem, (x, tuple(slice(None) if i is None else i for i in indices)), {}


@lowers(aten.einsum)
def _einsum(args: tuple, kwargs: dict, node: torch.fx.Node) -> Call:
    return "call_function", torch.einsum, (args[0], *args[1]), {}


@lowers(aten._to_copy, aten.to)
def _to(args: tuple, kwargs: dict, node: torch.fx.Node) -> Call:
    """``Tensor.to`` with the call's dtype and device: positional (``to.dtype``, ``to.other``, and ``to.device``
    which takes the dtype second) or keywords (``to.dtype_layout``, ``_to_copy``); copy flags do not matter here."""
    kept = {k: v for k, v in kwargs.items() if k in ("dtype", "device")}
    leading = 2 if overload_name(node.target) == "device" else 1
    return "call_method", "to", (args[0], *args[1:1 + leading]), kept


@lowers(aten.numpy_T)
def _numpy_t(args: tuple, kwargs: dict, node: torch.fx.Node) -> Call:
    """``Tensor.T``: every dim reversed, a permute."""
    return "call_method", "permute", (args[0], *reversed(range(args[0].meta["val"].dim()))), {}


@lowers(aten.alias, aten.lift_fresh_copy, aten.detach)
def _alias(args: tuple, kwargs: dict, node: torch.fx.Node) -> Call:
    return "call_method", "detach" if _opname(node) == "detach" else "clone", (args[0],), {}


def _same_name(packet: Any) -> Lowering | None:
    """An op whose torch function shares its name and schema (``aten.transpose`` and ``torch.transpose``), or
    an in-place op as the tensor method of its name (``aten.add_`` and ``Tensor.add_``)."""
    name = packet.__name__
    if name.startswith("_"):
        return None
    if name.endswith("_") and hasattr(torch.Tensor, name):
        return _method(name)
    target = getattr(torch, name, None)
    return _function(target) if callable(target) else None


def lower(graph: torch.fx.Graph) -> None:
    """Rewrite ``graph``'s ATen calls as torch-level calls, in place; drop export's runtime checks."""
    for node in list(graph.nodes):
        if node.op != "call_function" or not isinstance(node.target, OpOverload):
            continue
        packet = node.target.overloadpacket
        if packet in DROPPED:
            graph.erase_node(node)
            continue
        lowering = LOWERINGS.get(packet) or _same_name(packet)
        if lowering is None:
            continue
        op, target, args, kwargs = lowering(node.args, node.kwargs, node)
        with graph.inserting_before(node):
            new = graph.create_node(op, target, args, kwargs)
        new.meta = node.meta
        node.replace_all_uses_with(new)
        name = node.name
        graph.erase_node(node)
        rename_node(new, name)
    for node in list(graph.nodes):
        _fold_normalize(graph, node)
    _unshare_sizes(graph)


_SIZE_ARITHMETIC = (operator.mul, operator.add, operator.sub, operator.floordiv)


def _unshare_sizes(graph: torch.fx.Graph) -> None:
    """Give each user of a size computed from a literal (export computes ``batch * 16`` once for every block that
    views by it) a copy of its own: a literal rewritten for one block's units must not change another's."""
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _SIZE_ARITHMETIC or len(node.users) < 2 \
                or not any(isinstance(a, int) for a in node.args):
            continue
        for user in list(node.users)[1:]:
            with graph.inserting_before(user):
                copy = graph.create_node("call_function", node.target, node.args, node.kwargs)
            copy.meta = dict(user.meta)
            user.replace_input_with(node, copy)


def _fold_normalize(graph: torch.fx.Graph, div: torch.fx.Node) -> None:
    """``x / vector_norm(x, p, [d], True).clamp_min(eps).expand_as(x)``, what export records of ``F.normalize``,
    back to one ``F.normalize`` call: the norm of a unit's own features then stays with the unit."""
    parts = _normalize_parts(div)
    if parts is None:
        return
    x, options, dead = parts
    with graph.inserting_before(div):
        folded = graph.call_function(F.normalize, (x,), options)
    folded.meta = div.meta
    div.replace_all_uses_with(folded)
    for node in (div, *dead):
        graph.erase_node(node)


def _normalize_parts(div: torch.fx.Node) -> tuple[torch.fx.Node, dict, list[torch.fx.Node]] | None:
    """For a division that is ``F.normalize`` of ``x``: ``x``, the call's options and the nodes it replaces
    (each read only by the next); None for any other division."""
    if div.op != "call_function" or div.target is not operator.truediv or len(div.args) != 2:
        return None
    x, expanded = div.args
    if not _single_use(expanded, "call_method", "expand_as") or tuple(expanded.args[1:]) != (x,):
        return None
    clamped = expanded.args[0]
    if not _single_use(clamped, "call_function", torch.clamp_min) or len(clamped.args) != 2 or clamped.kwargs:
        return None
    norm = clamped.args[0]
    if not _single_use(norm, "call_function", aten.linalg_vector_norm.default) or norm.kwargs:
        return None
    source, p, dims, keepdim = (*norm.args, *(2, None, False)[len(norm.args) - 1:])
    if source is not x or not keepdim or not isinstance(dims, (list, tuple)) or len(dims) != 1:
        return None
    return x, {"p": p, "dim": dims[0], "eps": clamped.args[1]}, [expanded, clamped, norm]


def _single_use(node: Any, op: str, target: Any) -> bool:
    """``node`` is a call of ``target`` whose value nothing else reads."""
    return isinstance(node, torch.fx.Node) and node.op == op and node.target == target and len(node.users) == 1
