"""Where labels start and end: parameters and buffers, graph inputs, the graph output."""
from __future__ import annotations

from typing import Any

import torch
import torch.fx
import torch.nn.functional as F

from ...capture.held_objects import held_output_leaves
from ...capture.tracer import CODE_CONSTANT
from ..input_gathers import gather_units
from ..labeller import Label, Step
from ..rule_table import NodeKind
from .base import param_label, pin_all, register_rule

# functions whose rules read a parameter in these argument positions by its name, never by its labels
_READ_BY_NAME = {F.linear: (1, 2), F.conv1d: (1, 2), F.conv2d: (1, 2), F.conv3d: (1, 2), torch.addmm: (0, 2)}


@register_rule(NodeKind("get_attr"), always=True)
def get_attr(s: Step) -> Label | None:
    """Parameters and float buffers get one fresh id per element; integer buffers are indices. A weight that
    only linear maps and lookups read (a captured graph's ``F.linear(x, weight)``, ``F.embedding(ids, table)``)
    needs none: their rules name it (a vocabulary's table of 128256 × 4096 elements would take half a billion
    ids)."""
    if not torch.is_tensor(s.out) or not s.out.is_floating_point():
        return None
    if s.node.users and all(_read_by_name(user, s.node) or _looked_up_in(user, s.node) for user in s.node.users):
        return None
    if s.node.target.startswith(CODE_CONSTANT):  # like a parameter it joins the units it is used with alone
        ids = s.rec.fresh(tuple(s.out.shape))
        s.rec.pin(ids, f"{s.name}: a tensor the code made (not a parameter or buffer) spans the units: "
                       f"surgery cannot slice it")
        return Label(ids, True)
    return param_label(s, s.node.target, s.out)


def _read_by_name(user: torch.fx.Node, node: torch.fx.Node) -> bool:
    slots = _READ_BY_NAME.get(user.target) if user.op == "call_function" else None
    if slots is None or user.kwargs:
        return False
    return all(i in slots for i, a in enumerate(user.args) if a is node)


def _looked_up_in(user: torch.fx.Node, table: torch.fx.Node) -> bool:
    """``user`` is ``F.embedding`` with ``table`` as its table only and no ``max_norm``: the embedding rule reads
    the table by name (indices that carry ids it refuses, and their ids with them)."""
    if user.op != "call_function" or user.target is not F.embedding:
        return False
    args = dict(zip(("input", "weight", "padding_idx", "max_norm"), user.args)) | dict(user.kwargs)
    return args.get("weight") is table and args.get("max_norm") is None \
        and all(a is not table for k, a in args.items() if k != "weight")


@register_rule(NodeKind("output"), always=True)
def output(s: Step) -> Any:
    if s.lab.nested:  # the inside of an opaque function hands its labels back to the caller
        return s.largs[0]
    held = held_output_leaves(s.lab.module.graph)  # a returned cache's tensors: state at the units' widths
    if held:  # a captured graph returns its leaves flat
        labels = [lab for i, lab in enumerate(s.largs[0]) if i not in held and isinstance(lab, Label)]
    else:
        labels = [lab for _, lab in s.tensors() if lab is not None]
    for lab in labels:
        s.rec.pin(lab.ids, f"{s.name}: reaches the graph output", benign=True, at_output=True)
    return None


@register_rule(NodeKind("placeholder"), always=True)
def placeholder(s: Step) -> Any:
    return s.lab.seeds.get(s.node.target) if s.lab.nested else None


@register_rule(gather_units, always=True)
def gathered_input(s: Step) -> Label | None:
    """A host input read by the units' index buffer (``input_gathers``): the buffer is a member along its dim 0, one
    fresh id per entry, and the input's entries along ``dim`` carry the ids of the units they are read for, in runs,
    as a per-head parameter laid out along that dim would. An input that carries ids itself is refused."""
    if s.has_labels():
        pin_all(s, "a host input gathered by units carries unit coordinates of its own")
        return None
    index, dim = s.node.args[1], s.node.kwargs["dim"]
    ids = s.rec.fresh((s.args[1].numel(),))
    s.rec.member(index.target, ids)
    shape = [1] * s.out.dim()
    shape[dim] = s.out.shape[dim]
    return Label(ids.repeat(s.out.shape[dim] // max(ids.numel(), 1)).reshape(shape), True)
