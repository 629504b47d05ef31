"""Reads of sizes and metadata: they carry no ids, but a size read can follow the unit count."""
from __future__ import annotations

from typing import Any

import torch

from ..ids import align
from ..labeller import Label, Step
from .base import register_rule


@register_rule(getattr, always=True)
def attribute(s: Step) -> Any:
    if s.args[1] in ("shape",):
        s.rec.size_reads.add(s.node)
    xl = s.largs[0]
    if s.args[1] in ("T", "mT") and torch.is_tensor(s.out) and xl is not None:
        x = s.args[0]
        return Label(align(xl.ids, x.dim()).transpose(-2, -1), xl.param)
    if s.args[1] in ("values", "indices") and isinstance(xl, tuple):  # a reduction's (values, indices)
        return xl[("values", "indices").index(s.args[1])]
    return None


@register_rule("size", "dim", "numel", "__len__", always=True)
def size(s: Step) -> None:
    s.rec.size_reads.add(s.node)
    return None
