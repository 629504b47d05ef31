"""Where labels start and end: parameters and buffers, graph inputs, the graph output."""
from __future__ import annotations

from typing import Any

import torch

from ..labeller import Label, Step
from .base import RULES, param_label


def get_attr(s: Step) -> Label | None:
    """Parameters and float buffers get one fresh id per element; integer buffers are indices."""
    if not torch.is_tensor(s.out) or not s.out.is_floating_point():
        return None
    return param_label(s, s.node.target, s.out)


def output(s: Step) -> Any:
    if s.lab.nested:  # the inside of an opaque function hands its labels back to the caller
        return s.largs[0]
    for _, lab in s.tensors():
        if lab is not None:
            s.rec.pin(lab.ids, f"{s.name}: reaches the graph output", benign=True, at_output=True)
    return None


def placeholder(s: Step) -> Any:
    return s.lab.seeds.get(s.node.target) if s.lab.nested else None


RULES.always["get_attr"] = get_attr
RULES.always["output"] = output
RULES.always["placeholder"] = placeholder
