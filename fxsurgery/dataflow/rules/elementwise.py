"""Elementwise ops, activations, dropout and copies: the operands' coordinates are tied position by position."""
from __future__ import annotations

import operator

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..labeller import Label, Step
from .base import defer_pins, elementwise_labels, first_tensor, register_rule

_UNARY_FUNCS = [
    torch.relu, F.relu, F.gelu, F.silu, F.elu, F.leaky_relu, F.hardswish, F.hardsigmoid, F.mish,
    F.softplus, F.relu6, torch.sigmoid, torch.tanh, F.dropout, torch.exp, torch.neg, torch.abs,
    torch.sqrt, torch.rsqrt, torch.sin, torch.cos, torch.erf, torch.log, torch.square, torch.clamp,
    torch.clone, torch.detach, torch.zeros_like, torch.ones_like, torch.full_like, torch.empty_like,
    torch.rand_like, torch.randn_like, operator.neg, torch.nan_to_num, F.sigmoid, F.tanh, torch.clamp_min,
    torch.clamp_max,
]
_BINARY_FUNCS = [
    operator.add, operator.sub, operator.mul, operator.truediv, operator.pow, operator.iadd,
    operator.imul, operator.isub, operator.itruediv, torch.add, torch.sub, torch.mul, torch.div,
    torch.where, torch.maximum, torch.minimum, torch.pow, torch.lerp, torch.addcmul,
    torch.multiply, torch.subtract, torch.divide, torch.true_divide,  # the NumPy-style aliases
]
_ELEMENTWISE_METHODS = [
    "relu", "sigmoid", "tanh", "exp", "neg", "abs", "sqrt", "rsqrt", "sin", "cos", "erf", "log",
    "square", "clamp", "clip", "pow", "add", "sub", "mul", "div", "where", "lerp",
    "zero", "fill", "nan_to_num", "softplus", "addcmul", "maximum", "minimum", "clamp_min", "clamp_max",
    "multiply", "subtract", "divide", "true_divide",
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


@register_rule(*_UNARY_FUNCS, *_BINARY_FUNCS, *_ELEMENTWISE_METHODS)
def elementwise(s: Step) -> Label | None:
    if not torch.is_tensor(s.out):
        return None
    return elementwise_labels(s, list(s.tensors()), s.out.dim())


@register_rule(torch.masked_fill, "masked_fill")
def masked_fill(s: Step) -> Label | None:
    """``x.masked_fill(mask, value)``: the output carries the ids of ``x`` (and of a tensor ``value``). The mask
    only picks positions and cannot be sliced: units it lines up with, and any coordinates it carries, are
    pinned."""
    x, xl = s.arg(0, "input")
    mask, mask_label = s.arg(1, "mask")
    value, value_label = s.arg(2, "value")
    operands = [(x, xl)] + ([(value, value_label)] if torch.is_tensor(value) else [])
    out = elementwise_labels(s, operands, s.out.dim())
    if mask_label is not None:
        s.rec.pin(mask_label.ids, f"{s.name}: a mask computed from unit coordinates", True)
    if out is not None:
        defer_pins(s, out.ids, tuple(mask.shape), "the mask", benign=False)
    return out


@register_rule(*_PASSTHROUGH_METHODS)
def passthrough(s: Step) -> Label | None:
    """Copies and dtype/device moves: the first tensor's ids (later tensor arguments only give a dtype)."""
    x, xl = first_tensor(s)
    return xl if torch.is_tensor(s.out) else None


@register_rule(*_ELEMENTWISE_MODULES)
def elementwise_module(s: Step) -> Label | None:
    return elementwise(s)
