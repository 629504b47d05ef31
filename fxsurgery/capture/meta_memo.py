"""Meta runs that repeat themselves: the blocks of a model built alike run the same ops on the same shapes, and many
meta kernels are Python code (layer norm, attention, the elementwise prims), so a meta run of a deep model spends
most of its time working out shapes it has already worked out. ``MetaMemo`` remembers, within one run, the
shapes, strides and dtypes each op returned for its inputs' metadata, and hands later calls new meta tensors of
that layout without running the kernel again. Inside ``shared_layouts`` (one analysis, which runs the same blocks'
ops several times: labelling the whole model, capturing the hosts' calls, labelling each host) every run shares
what the runs before it worked out.

Only ops that return new tensors (no view, nothing written in place) on meta inputs alone are remembered: their
result is a function of the inputs' metadata and the plain arguments. Anything else runs as it would without
the memo.
"""
from __future__ import annotations

import functools
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Hashable, Iterator

import torch
import torch.nn as nn

from ..compat import DispatchMode, returns_new_tensors

# plain arguments an op's result may depend on; each is keyed with its type (``2`` and ``2.0`` promote apart)
_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)
_TENSOR_TYPES = (torch.Tensor, nn.Parameter)
_SHARED: ContextVar[dict[Hashable, Any] | None] = ContextVar("fxsurgery_shared_layouts", default=None)


@contextmanager
def shared_layouts() -> Iterator[None]:
    """Every ``MetaMemo`` made inside shares one table of layouts (a nested use keeps the outer table)."""
    token = _SHARED.set({} if _SHARED.get() is None else _SHARED.get())
    try:
        yield
    finally:
        _SHARED.reset(token)


class Unkeyable(Exception):
    """An argument whose metadata does not decide the result (real data, a generator, a symbolic size)."""


class MetaMemo(DispatchMode):
    """While active, an op that returns new tensors for meta inputs runs once per metadata of its arguments."""

    def __init__(self) -> None:
        super().__init__()
        shared = _SHARED.get()
        # (op, arguments' metadata) -> the layout of what it returned
        self.known: dict[Hashable, Any] = {} if shared is None else shared

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        key = _call_key(func, args, kwargs) if _returns_new_tensors(func) else None
        if key in self.known:
            return _rebuild(self.known[key])
        out = func(*args, **kwargs)
        if key is not None:
            layout = _layout(out, {id(t) for t in _tensors((args, kwargs))})
            if layout is not None:
                self.known[key] = layout
        return out


@functools.cache
def _returns_new_tensors(func: Any) -> bool:
    return returns_new_tensors(func)  # read once per op: its schema does not change


def _call_key(func: Any, args: tuple, kwargs: dict) -> Hashable | None:
    """The op and its arguments' metadata, or None where the result may depend on more than that."""
    try:
        return func, _key(args), _key(tuple(sorted(kwargs.items())))
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
