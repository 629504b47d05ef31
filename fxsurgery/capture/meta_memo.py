"""Meta runs that repeat themselves: the blocks of a model built alike run the same ops on the same shapes, and many
meta kernels are Python code (layer norm, attention, the elementwise prims), so a meta run of a deep model spends
most of its time working out shapes it has already worked out. ``MetaMemo`` remembers the shapes, strides and
dtypes each op returned for its inputs' metadata, and hands later calls new meta tensors of that layout without
running the kernel again. One table serves the whole process: an analysis runs the same blocks' ops several times
(labelling the whole model, capturing the hosts' calls, labelling each host), and analyses of models built alike
(a model analysed again for another call) run them again.

Only ops that return new tensors (no view, nothing written in place) on meta inputs alone are remembered: their
result is a function of the inputs' metadata, the plain arguments and the default dtype (an integer tensor times a
float, a factory call without a dtype), all of which the key holds. Anything else runs as it would without the memo.
"""
from __future__ import annotations

import functools
from typing import Any, Hashable

import torch
import torch.nn as nn

from ..compat import DispatchMode, returns_new_tensors

# plain arguments an op's result may depend on; each is keyed with its type (``2`` and ``2.0`` promote apart)
_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)
_TENSOR_TYPES = (torch.Tensor, nn.Parameter)
# (op, arguments' metadata, default dtype) -> the layout of what it returned; emptied when it reaches the bound
LAYOUTS: dict[Hashable, Any] = {}
MAX_LAYOUTS = 1 << 16


class Unkeyable(Exception):
    """An argument whose metadata does not decide the result (real data, a generator, a symbolic size)."""


class MetaMemo(DispatchMode):
    """While active, an op that returns new tensors for meta inputs runs once per metadata of its arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.known = LAYOUTS

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        key = _call_key(func, args, kwargs) if _returns_new_tensors(func) else None
        if key in self.known:
            return _rebuild(self.known[key])
        out = func(*args, **kwargs)
        if key is not None:
            layout = _layout(out, {id(t) for t in _tensors((args, kwargs))})
            if layout is not None:
                if len(self.known) >= MAX_LAYOUTS:
                    self.known.clear()
                self.known[key] = layout
        return out


@functools.cache
def _returns_new_tensors(func: Any) -> bool:
    return returns_new_tensors(func)  # read once per op: its schema does not change


def _call_key(func: Any, args: tuple, kwargs: dict) -> Hashable | None:
    """The op, its arguments' metadata and the default dtype, or None where the result may depend on more."""
    try:
        return func, _key(args), _key(tuple(sorted(kwargs.items()))), torch.get_default_dtype()
    except Unkeyable:
        return None


def _key(x: Any) -> Hashable:
    if isinstance(x, torch.Tensor):
        if type(x) not in _TENSOR_TYPES or not x.is_meta:
            raise Unkeyable
        return "tensor", tuple(x.shape), x.stride(), x.storage_offset(), x.dtype, x.is_conj(), x.is_neg()
    if isinstance(x, (list, tuple)):
        return type(x), tuple(_key(v) for v in x)
    if isinstance(x, _PLAIN):
        return type(x), x
    raise Unkeyable


def _layout(out: Any, inputs: set[int]) -> tuple | None:
    """How to make ``out`` again: new meta tensors (no offset, no conj/neg bits, none of the inputs) and plain
    values, nested in tuples and lists; None for anything else."""
    if isinstance(out, torch.Tensor):
        if type(out) is not torch.Tensor or not out.is_meta or id(out) in inputs or out.storage_offset() \
                or out.is_conj() or out.is_neg():
            return None
        return "tensor", tuple(out.shape), out.stride(), out.dtype
    if isinstance(out, (list, tuple)):
        parts = [_layout(o, inputs) for o in out]
        return None if any(p is None for p in parts) else ("sequence", type(out), parts)
    if isinstance(out, _PLAIN):
        return "value", out
    return None


def _rebuild(layout: tuple) -> Any:
    if layout[0] == "tensor":
        _, shape, stride, dtype = layout
        return torch.empty_strided(shape, stride, dtype=dtype, device="meta")
    if layout[0] == "sequence":
        return layout[1]([_rebuild(p) for p in layout[2]])
    return layout[1]


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors(o)]
    return []
