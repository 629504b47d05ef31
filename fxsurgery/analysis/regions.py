"""Which graphs to trace: the whole model if it traces (plus the modules the tracer keeps opaque),
else the largest submodules that do; and which modules host the groups found there."""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch.fx
import torch.nn as nn

from ..capture.calls import capture_inputs
from ..capture.decompositions import CALLER_HOSTED
from ..capture.front_ends import record
from ..dataflow.paths import common_module, join_path, within
from ..errors import AnalysisError, TraceError, unforeseen
from ..runtime.call_signature import without_objects
from .find import TracedCall, locate_groups

LeaveOut = Callable[[str, list[str]], None]  # report a module as left out, with reasons


class Region(NamedTuple):
    """A traced graph of the module at ``prefix`` ("" for the model) and its placeholders' values."""

    prefix: str
    gm: torch.fx.GraphModule
    values: list


class TraceFailure(NamedTuple):
    module: str
    error: TraceError


def find_regions(model: nn.Module, example: tuple[tuple, dict],
                 leave_out: LeaveOut) -> tuple[list[Region], list[TraceFailure]]:
    """The whole model if it traces (plus the modules it keeps as opaque fx leaves), else the
    largest submodules that do."""
    try:
        gm, values, _ = record(model, "", *example, model.training, replayed=False)
    except TraceError as e:
        return _submodule_regions(model, example, [TraceFailure("", e)])
    leaves = [n.target for n in gm.graph.nodes if n.op == "call_module"
              and not type(gm.get_submodule(n.target)).__module__.startswith("torch.")]
    regions = [Region("", gm, values)]
    calls = capture_inputs(model, example, leaves) if leaves else {}
    for name in leaves:
        if name in calls:
            try:
                call = without_objects(calls[name])
                regions.append(Region(name, *record(model.get_submodule(name), name, *call, model.training,
                                                       replayed=False)[:2]))
            except TraceError as err:
                leave_out(name, [f"kept opaque by the tracer and not traceable: {err}"])
    return regions, []


def _submodule_regions(model: nn.Module, example: tuple[tuple, dict],
                       failures: list[TraceFailure]) -> tuple[list[Region], list[TraceFailure]]:
    names = [n for n, _ in model.named_modules() if n]
    calls = capture_inputs(model, example, names)
    regions = []

    def visit(prefix: str, module: nn.Module) -> None:
        for child, sub in module.named_children():
            q = join_path(prefix, child)
            if q not in calls:  # containers such as ModuleList are never called themselves
                visit(q, sub)
                continue
            try:
                regions.append(Region(q, *record(sub, q, *without_objects(calls[q]), sub.training, replayed=False)[:2]))
            except TraceError as err:
                failures.append(TraceFailure(q, err))
                visit(q, sub)

    visit("", model)
    return regions, failures


class Located(NamedTuple):
    """The hosts, and each module's first call in the traced graphs (by its path in the model)."""

    hosts: list[str]
    calls: dict[str, TracedCall]


def locate_hosts(model: nn.Module, regions: list[Region], leave_out: LeaveOut) -> Located:
    """The outermost modules that host a candidate group (each is traced again on its own), in the order
    the model runs them (the order their groups appear in the traced graphs). A host inside a module that another
    host's graph keeps opaque (a region of its own) is kept: that graph does not see its groups. Where the model's
    own graph locates none and refuses some (a module it keeps whole meets them: a call with no rule), the model is
    the one host, so that its analysis may try the concrete-shape capture, which sees into such modules."""
    found: dict[str, str] = {}  # host -> the region it was found in
    calls: dict[str, TracedCall] = {}
    refused_whole = False  # the model's own graph was labelled, located nothing and refused something
    for prefix, gm, values in regions:
        try:
            result, region_calls = locate_groups(gm, values, prefix)
        except AnalysisError as err:  # this region is left out; the others go on
            leave_out(prefix, [str(err)])
            continue
        except Exception as err:  # an unforeseen failure leaves this region out, naming the error and where it arose
            leave_out(prefix, [unforeseen(f"locating the unit groups of {prefix or 'the model'}", err)])
            continue
        for path, call in region_calls.items():
            calls.setdefault(join_path(prefix, path), call)
        for modules in result.located:
            found.setdefault(join_path(prefix, _host_within(model, prefix, gm, common_module(modules))), prefix)
        for r in result.refusals:
            leave_out(join_path(prefix, common_module(r.modules)), r.reasons)
        refused_whole |= not prefix and not result.located and bool(result.refusals)
    if not found and refused_whole:
        return Located([""], calls)
    return Located([h for h, region in found.items()
                    if not any(within(h, o) and not (within(region, o) and region != o) for o in found if o != h)],
                   calls)


def _host_within(model: nn.Module, prefix: str, gm: torch.fx.GraphModule, path: str) -> str:
    """The module of ``gm`` (a region traced at ``prefix``) that hosts a group found at ``path``: the
    module itself, or for a caller-hosted torch module the nearest module that called it."""
    while path and type(model.get_submodule(join_path(prefix, path))) in CALLER_HOSTED:
        path = _caller(gm, path)
    return path


def _caller(gm: torch.fx.GraphModule, path: str) -> str:
    """The module that called the module ``path`` in ``gm``'s trace ("" for the traced root)."""
    for node in gm.graph.nodes:
        stack = [p for p, _ in node.meta.get("nn_module_stack", {}).values()]
        if path in stack:
            i = stack.index(path)
            return stack[i - 1] if i else ""
    return ""
