"""One host module's analysis: its train and eval graphs and the groups found in both; a fingerprint
says which hosts are built alike, so one analysis (copied) serves them all."""
from __future__ import annotations

import copy
import functools
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import torch
import torch.fx
import torch.nn as nn
from torch.fx.node import map_arg

from ..capture.calls import attributes_read, training_mode
from ..capture.front_ends import FrontEnd, FrontEndUse, Recording, record, record_concrete
from ..capture.tracer import CODE_CONSTANT
from ..compat import pytree_info, tree_leaves
from ..dataflow.constants import ConstantSpec
from ..dataflow.grouping import GroupSpec, Refusal, TapSite
from ..errors import AnalysisError, TraceError
from .find import GraphGroups, find_groups


@dataclass
class HostGroup:
    """A group found in both graphs of a host: its spec, and the constants and tap sites of both graphs. A stage of
    its own: one per kind of host (hosts built alike share it), where a ``GroupSpec`` is of one graph and a
    ``groups.GroupPlumbing`` of one installed host."""

    spec: GroupSpec
    constants: list[ConstantSpec]
    sites: list[TapSite]


@dataclass
class HostAnalysis:
    """The graphs and groups found for one host module; a copy serves any host built alike."""

    graphs: dict[bool, torch.fx.Graph]
    groups: list[HostGroup]
    refusals: list[Refusal]
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # constants tracing created
    front_end: FrontEndUse = FrontEndUse(FrontEnd.SYMBOLIC)  # which front end recorded the graphs, and why

    def copy(self) -> HostAnalysis:
        """Fresh graphs, with every constant re-pointed to the same-named node of its graph's copy."""
        copies = {id(g): copy.deepcopy(g) for g in self.graphs.values()}
        by_name = {gid: {n.name: n for n in g.nodes} for gid, g in copies.items()}
        def same(node: torch.fx.Node) -> torch.fx.Node:
            return by_name[id(node.graph)][node.name]

        groups = [HostGroup(hg.spec, [ConstantSpec(same(c.node), c.path, c.per_unit) for c in hg.constants],
                            [site._replace(sink=same(site.sink), input=same(site.input)) for site in hg.sites])
                  for hg in self.groups]
        return HostAnalysis({m: copies[id(g)] for m, g in self.graphs.items()}, groups, self.refusals, self.tensors,
                            self.front_end)


class HostKey(NamedTuple):
    """Which hosts are built alike (``fingerprint``): per module, its path, type, plain attributes (``repr``),
    parameter shapes and dtypes, and buffer shapes, dtypes and integer contents (hashed); and the call's tensor
    shapes and dtypes and its other values (``repr``)."""

    modules: tuple
    call: tuple


def fingerprint(module: nn.Module, args: tuple, kwargs: dict) -> HostKey:
    """Everything tracing and analysis read: module types, plain attributes, parameter shapes,
    integer buffer contents, and the call's input shapes and frozen values. An attribute the call's code does not
    read (``attributes_read``: a block's index, read only by a key/value cache's update) is named without its
    value, so that the blocks of a deep model are built alike."""
    read = attributes_read(module, args, kwargs) if (args or kwargs) else None
    parts = []
    for name, m in module.named_modules():
        attrs = tuple(sorted((k, repr(v) if read is None or (name, k) in read else None) for k, v in vars(m).items()
                             if not k.startswith("_") and not isinstance(v, (torch.Tensor, nn.Module))))
        params = tuple((k, tuple(p.shape), p.dtype) for k, p in m.named_parameters(recurse=False))
        buffers = tuple((k, tuple(b.shape), b.dtype, None if b.is_floating_point() else hash(b.cpu().numpy().tobytes()))
                        for k, b in m.named_buffers(recurse=False))
        parts.append((name, type(m), attrs, params, buffers))
    call = tuple((tuple(t.shape), t.dtype) if torch.is_tensor(t) else repr(t)
                 for t in tree_leaves((args, kwargs)))
    return HostKey(tuple(parts), call)


def analyse_host(module: nn.Module, host: str, args: tuple, kwargs: dict,
                 modes: tuple[bool, ...] = (True, False), *, returns_units: bool = False) -> HostAnalysis:
    """Trace the host in train and eval mode (or in ``modes``) and find its groups in every graph. Where the
    symbolic trace leaves units out, the concrete-shape capture is tried too and serves if it finds more groups.
    ``returns_units``: channels the graphs return may be units (a call of a new signature: ``runtime.recapture``)."""
    analyse_with = functools.partial(_analyse_with, returns_units=returns_units)
    found = analyse_with(record, module, host, args, kwargs, modes)
    if found.refusals and found.front_end.front_end is FrontEnd.SYMBOLIC:
        why = f"the symbolic trace left out: {found.refusals[0].reasons[0]}"
        concrete, recorded = functools.partial(record_concrete, why=why), {}
        try:
            # the groups found in every mode are some of those of the first: where its capture finds no more than
            # the symbolic trace did, the other modes are not captured (a whole model's capture takes many seconds)
            first = analyse_with(concrete, module, host, args, kwargs, modes[:1], recorded=recorded)
            if len(first.groups) <= len(found.groups):
                return found
            captured = analyse_with(concrete, module, host, args, kwargs, modes, recorded=recorded)
        except (TraceError, AnalysisError):
            return found
        if len(captured.groups) > len(found.groups):
            return captured
    return found


def same_graphs(a: torch.fx.Graph, b: torch.fx.Graph) -> bool:
    """The graphs make the same code: node for node the same names, ops, targets, types and arguments (nodes by
    name), and the same flattening of inputs and outputs. Read from the nodes, not from generated code."""
    if len(a.nodes) != len(b.nodes) or pytree_info(a) != pytree_info(b):
        return False
    for x, y in zip(a.nodes, b.nodes):
        if (x.name, x.op, x.target, x.type) != (y.name, y.op, y.target, y.type):
            return False
        try:
            if map_arg((x.args, x.kwargs), _name) != map_arg((y.args, y.kwargs), _name):
                return False
        except RuntimeError:  # a tensor among the arguments: told apart
            return False
    return True


def _name(node: torch.fx.Node) -> str:
    return node.name


class _ModeRecord(NamedTuple):
    """One mode's graph as a front end recorded it, the groups found in it, and the constants tracing created."""

    graph: torch.fx.Graph
    found: GraphGroups
    tensors: dict[str, torch.Tensor]
    front_end: FrontEndUse


def _record_mode(front_end: Callable[..., Recording], module: nn.Module, host: str, args: tuple, kwargs: dict,
                 mode: bool, train: _ModeRecord | None, *, returns_units: bool) -> _ModeRecord:
    """The host recorded in ``mode`` and its groups; an eval graph the same as the train one (``train``) shares
    its groups."""
    gm, values, used = front_end(module, host, args, kwargs, mode)
    tensors = {n.target: getattr(gm, n.target) for n in gm.graph.nodes
               if n.op == "get_attr" and n.target.startswith(CODE_CONSTANT)}
    if mode is False and train is not None and same_graphs(gm.graph, train.graph):
        return train._replace(tensors={**train.tensors, **tensors}, front_end=used)
    with training_mode(module, mode):
        return _ModeRecord(gm.graph, find_groups(gm, values, host, returns_units=returns_units), tensors, used)


def _analyse_with(front_end: Callable[..., Recording], module: nn.Module, host: str, args: tuple,
                  kwargs: dict, modes: tuple[bool, ...], *, returns_units: bool,
                  recorded: dict[bool, _ModeRecord] | None = None) -> HostAnalysis:
    """The groups found in the graphs of every mode of ``modes``; ``recorded``: the modes recorded by this front
    end so far, kept for a later call (filled in here)."""
    recorded = {} if recorded is None else recorded
    for mode in modes:
        if mode not in recorded:
            recorded[mode] = _record_mode(front_end, module, host, args, kwargs, mode, recorded.get(True),
                                          returns_units=returns_units)
    graphs = {mode: recorded[mode].graph for mode in modes}
    results = {mode: recorded[mode].found for mode in modes}
    tensors = {name: t for mode in modes for name, t in recorded[mode].tensors.items()}
    used = recorded[modes[-1]].front_end
    first, last = results[modes[0]], results[modes[-1]]
    eval_specs = {(s.sink, s.kind): s for s in last.groups}  # a fused output projection reads heads and channels
    groups, refusals = [], list(first.refusals)
    for spec in first.groups:
        other = eval_specs.get((spec.sink, spec.kind))
        if other is None or other.count != spec.count:
            refusals.append(Refusal(spec.modules, ["train and eval graphs disagree about this group"]))
            continue
        if not spec.sites or not other.sites:
            refusals.append(Refusal(spec.modules, [f"{spec.sink} is called inside an opaque function: no tap "
                                                   "could see the units it reads"]))
            continue
        both = other is not spec
        groups.append(HostGroup(spec, spec.constants + (other.constants if both else []),
                                spec.sites + (other.sites if both else [])))
    return HostAnalysis(graphs, groups, refusals, tensors, used)
