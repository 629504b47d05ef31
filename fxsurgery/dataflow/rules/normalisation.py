"""Normalisations and reductions mix the coordinates they normalise or reduce over."""
from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..constants import ConstantSpec, Site
from ..ids import align, varies
from ..labeller import Label, Step
from ..records import NonEmpty, Weighing
from .base import RULES, elementwise_labels, first_tensor, mix, param_label, pin_all, register_rule, wrap_dim


def _normalise(s: Step, x: torch.Tensor, xl: Label | None, dims: Sequence[int], what: str,
               affine: Sequence[Any] = ()) -> Label | None:
    if xl is not None:
        mix(s, align(xl.ids, x.dim()), dims, what)
    operands = [(x, xl)] + [a for a in affine if a is not None]
    return elementwise_labels(s, operands, x.dim())


def _softmax(s: Step, x: torch.Tensor, xl: Label | None, dim: int) -> Label | None:
    """A softmax mixes what it normalises; it is recorded, so one that weighs no heads can be told of."""
    d = wrap_dim(dim, x.dim())
    if xl is not None and not xl.param:
        s.rec.softmaxes.append(Weighing(s.node, align(xl.ids, x.dim()), d, x.shape[d] if x.dim() else 1))
    return _normalise(s, x, xl, [d], "softmax")


@register_rule(F.softmax, torch.softmax, F.log_softmax, torch.log_softmax, "softmax", "log_softmax")
def softmax(s: Step) -> Label:
    x, xl = first_tensor(s)
    return _softmax(s, x, xl, s.arg(1, "dim")[0])


@register_rule(nn.Softmax)
def softmax_module(s: Step) -> Label:
    x, xl = first_tensor(s)
    return _softmax(s, x, xl, s.lab.module.get_submodule(s.node.target).dim)


@register_rule(F.layer_norm, F.rms_norm)
def layer_norm(s: Step) -> Label:
    x, xl = s.arg(0, "input")
    shape = s.arg(1, "normalized_shape")[0]
    dims = list(range(x.dim() - len(shape), x.dim()))
    w, b = s.arg(2, "weight"), s.arg(3, "bias") if s.node.target is F.layer_norm else (None, None)
    affine = [a for a in (w, b) if torch.is_tensor(a[0])]
    return _normalise(s, x, xl, dims, "normalisation", affine)


@RULES.constants(F.layer_norm, F.rms_norm)
def layer_norm_constants(site: Site) -> list[ConstantSpec]:
    if site.in_dim is None:
        return []
    shape = site.node.args[1]
    first = len(site.in_shape) - len(shape)
    if site.in_dim < first:
        return []
    return [site.constant(("args", 1, site.in_dim - first), site.in_shape[site.in_dim])]


@register_rule(nn.LayerNorm, nn.RMSNorm)
def layer_norm_module(s: Step) -> Label:
    x, xl = first_tensor(s)
    mod = s.lab.module.get_submodule(s.node.target)
    dims = list(range(x.dim() - len(mod.normalized_shape), x.dim()))
    affine = []
    for pname in ("weight", "bias"):
        p = getattr(mod, pname, None)
        if p is not None:
            affine.append((p, param_label(s, f"{s.node.target}.{pname}", p)))
    return _normalise(s, x, xl, dims, "normalisation", affine)


def _batch_norm(s: Step, x: torch.Tensor, xl: Label | None,
                per_channel: Sequence[tuple[Any, Label | None]]) -> Label | None:
    """Statistics are per channel (dim 1), in training (the batch's) and in evaluation (the running ones):
    channels stay separate, so a unit's channels are cut exactly, and the affine weights and running statistics
    (``per_channel``, 1-d) are elementwise operands along dim 1, members sliced with the units. torch's batch norm
    takes no input without channels."""
    if xl is None:
        return None
    ids = align(xl.ids, x.dim())
    mix(s, ids, [d for d in range(x.dim()) if d != 1], "batch normalisation")
    s.rec.nonempty.append(NonEmpty(ids, f"{s.name}: a batch norm cannot have zero channels"))
    along_channels = (-1, *([1] * (x.dim() - 2)))
    operands = [(x, Label(ids))]
    for t, label in per_channel:
        if torch.is_tensor(t):
            channel_label = Label(label.ids.reshape(along_channels), label.param) if label is not None else None
            operands.append((t.reshape(along_channels), channel_label))
    return elementwise_labels(s, operands, x.dim())


@register_rule(nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
def batch_norm_module(s: Step) -> Label | None:
    """A batch norm module (an fx leaf): its float tensors are per-channel members."""
    x, xl = first_tensor(s)
    if xl is None:
        return None
    mod = s.lab.module.get_submodule(s.node.target)
    tensors = [(pname, getattr(mod, pname, None)) for pname in ("weight", "bias", "running_mean", "running_var")]
    per_channel = [(p, param_label(s, f"{s.node.target}.{pname}", p)) for pname, p in tensors
                   if torch.is_tensor(p) and p.is_floating_point()]
    return _batch_norm(s, x, xl, per_channel)


@register_rule(F.batch_norm)
def batch_norm(s: Step) -> Label | None:
    """``F.batch_norm(input, running_mean, running_var, weight, bias, ...)``, as a symbolic trace records it."""
    x, xl = s.arg(0, "input")
    names = ("running_mean", "running_var", "weight", "bias")
    return _batch_norm(s, x, xl, [s.arg(i, name) for i, name in enumerate(names, 1)])


@register_rule(torch.batch_norm)
def captured_batch_norm(s: Step) -> Label | None:
    """``torch.batch_norm(input, weight, bias, running_mean, running_var, ...)``, the lowered ATen op of a captured
    graph (``num_batches_tracked`` is counted beside it, a shared scalar and no member)."""
    x, xl = s.arg(0, "input")
    names = ("weight", "bias", "running_mean", "running_var")
    return _batch_norm(s, x, xl, [s.arg(i, name) for i, name in enumerate(names, 1)])


@register_rule(F.normalize)
def normalize(s: Step) -> Label:
    x, xl = first_tensor(s)
    d = s.arg(2, "dim", 1)[0]
    return _normalise(s, x, xl, [wrap_dim(d, x.dim())], "normalisation")


@register_rule(torch.sum, torch.mean, torch.amax, torch.amin, torch.logsumexp, torch.norm, torch.var, torch.std,
               "sum", "mean", "amax", "amin", "logsumexp", "norm", "var", "std")
def reduce(s: Step) -> Label | None:
    return _reduce(s, s.out)


def _reduce(s: Step, out: torch.Tensor) -> Label | None:
    """A reduction over ``dim`` (all dims where None) whose result is ``out``: it mixes the coordinates it reduces."""
    x, xl = first_tensor(s)
    ids = align(xl.ids, x.dim())
    dim = s.arg(2 if s.node.target in ("norm",) or s.node.target is torch.norm else 1, "dim")[0]
    listed = dim if isinstance(dim, (tuple, list)) else [dim]
    dims = list(range(x.dim())) if dim is None else [wrap_dim(d, x.dim()) for d in listed]
    mix(s, ids, dims, "reduction")
    if any(varies(ids, d) for d in dims):
        if not any(varies(ids, d) for d in range(x.dim()) if d not in dims):
            return None
        ids = ids.amax(dim=dims, keepdim=True)  # within blocks (a head's own coordinates): as the mix represents them
    keep = out.dim() == x.dim()
    out_ids = ids if keep else ids.reshape([n for k, n in enumerate(ids.shape) if k not in dims])
    return Label(out_ids, xl.param)


@register_rule(torch.topk, "topk")
def top_k(s: Step) -> None:
    """``topk`` picks coordinates by their values. Where coordinates of units compete along ``dim`` (a router's
    logits, one per expert) the data chooses among them: removing one changes which the others are picked with, so no
    removal equals masking it, and they are pinned saying so; elsewhere (top-k positions) as an op with no rule."""
    x, xl = s.arg(0, "input")
    dim = wrap_dim(s.arg(2, "dim", -1)[0], x.dim())
    competing = xl is not None and varies(xl.ids, dim)
    pin_all(s, "a top-k choice among units that the data makes (a router picking experts): removing one would change "
               "which of the others are picked, so no removal equals masking it" if competing else "no rule for topk")


@register_rule(torch.max, torch.min, "max", "min")
def extremum(s: Step) -> Label | tuple[Label | None, Label | None] | None:
    """``max``/``min``: of two tensors, elementwise; over all dims, a reduction; over ``dim``, a reduction whose
    values and indices (positions along ``dim``) both carry the coordinates of the dims kept."""
    other = s.arg(1, "other")[0]
    if torch.is_tensor(other):
        return elementwise_labels(s, list(s.tensors()), s.out.dim())
    if torch.is_tensor(s.out):
        return _reduce(s, s.out)
    label = _reduce(s, s.out[0])
    return (label, label)
