"""Calls into a host's modules that do not come through the host's forward (timm's `forward_features` on a model
whose host is the whole model, a feature extractor calling a block): the installed graphs serve the host's forward
only, so such a call runs the modules' own code on the compact tensors. A guard on each module the graphs trace
through lets the call run where the host's own code follows the widths (fitted as for the calls its own forward
serves, `HostServer.fit_own_forward`), with the count attributes it reads set as the own forward sets them for the
call, and refuses it, naming the module and what goes wrong, where it does not: a crash on the compact tensors at
best, a wrong result at worst."""
from __future__ import annotations

import contextlib
from typing import Iterable

import torch
import torch.fx
import torch.nn as nn

from ..compat import module_hooks
from ..errors import UnservedCall
from .graph_forward import GraphForward
from .own_forward import SERVING, own_code_serving


class OutsideCallGuard:
    """The forward pre-hook of a module within ``host`` that the host's graphs trace through. A call from outside
    that it lets run runs in ``own_code_serving`` (the calls it makes pass), left by the module's ``GuardedCallEnd``."""

    fxsurgery_internal = True  # not a hook an installed graph must honour (``hooked_submodules``)

    def __init__(self, host: nn.Module, host_name: str, name: str) -> None:
        self.host, self.host_name, self.name = host, host_name, name
        self.calls: list[contextlib.ExitStack | None] = []  # per running call of the module: what it entered

    def __call__(self, module: nn.Module, args: tuple) -> None:
        self.calls.append(None)
        if self.host.__dict__.get(SERVING, 0) or GraphForward.of(module) is not None:
            return
        why = outside_refusal(self.host)
        if why:
            raise UnservedCall(f"{self.name} ({type(module).__name__}) is called outside the forward of "
                               f"{self.host_name or 'the model'} ({type(self.host).__name__}), whose graphs serve "
                               f"its modules on the compact tensors; their own code {why}: call "
                               f"{self.host_name or 'the model'} itself")
        server = GraphForward.of(self.host).server
        stack = contextlib.ExitStack()
        stack.enter_context(own_code_serving(self.host, server.groups, server.fit.counts))
        self.calls[-1] = stack


class GuardedCallEnd:
    """The forward hook, run however the call ends, that leaves what the module's guard entered for the call."""

    fxsurgery_internal = True

    def __init__(self, guard: OutsideCallGuard) -> None:
        self.guard = guard

    def __call__(self, module: nn.Module, args: tuple, output: object) -> None:
        stack = self.guard.calls.pop() if self.guard.calls else None
        if stack is not None:
            stack.close()


def outside_refusal(host: nn.Module) -> str:
    """Why ``host``'s modules cannot run their own code on its compact tensors now ("" if they can)."""
    server = GraphForward.of(host).server
    if server is None:
        return "cannot be checked (nothing fits the host's own forward)"
    server.fit_own_forward()
    fit = server.fit
    if fit.fault:
        return fit.fault
    if fit.gathers:
        return "reads module inputs through the units' indices only in the calls the host's forward serves"
    if fit.empty_fault and server.has_empty_group(host):
        return f"{fit.empty_fault} (a group of it has no units)"
    if torch.is_grad_enabled() and any(host.__dict__[r.tap_point].active(True) for r in server.groups):
        return "passes no tap point of the host's tapped groups"
    return ""


def guard_outside_calls(host: nn.Module, host_name: str, graphs: Iterable[torch.fx.Graph]) -> None:
    """Guard every module within ``host`` that holds parameters and that ``graphs`` trace through (a module they call,
    and what it calls, runs inside them)."""
    called = {node.target for graph in graphs for node in graph.nodes if node.op == "call_module"}
    inside = {id(m) for target in called for m in host.get_submodule(target).modules()}
    for name, module in host.named_modules():
        if module is host or id(module) in inside or next(module.parameters(), None) is None:
            continue
        if not any(isinstance(hook, OutsideCallGuard) for hook in module_hooks(module)):
            guard = OutsideCallGuard(host, host_name, f"{host_name}.{name}".strip("."))
            module.register_forward_pre_hook(guard)
            module.register_forward_hook(GuardedCallEnd(guard), always_call=True)
