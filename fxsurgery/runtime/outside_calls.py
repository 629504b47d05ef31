"""Calls into a host's modules that do not come through the host's forward (timm's `forward_features` on a model
whose host is the whole model, a feature extractor calling a block): the installed graphs serve the host's forward
only, so such a call runs the modules' own code on the compact tensors. A guard on each module the graphs trace
through lets the call run where the host's own code follows the widths as it is (fitted as for the calls its own
forward serves, `HostServer.fit_own_forward`: no count it reads needs setting), and refuses it, naming the module
and what goes wrong, where it does not: a crash on the compact tensors at best, a wrong result at worst."""
from __future__ import annotations

from typing import Iterable

import torch
import torch.fx
import torch.nn as nn

from ..compat import module_hooks
from ..errors import UnservedCall
from .graph_forward import GraphForward
from .own_forward import SERVING


class OutsideCallGuard:
    """The forward pre-hook of a module within ``host`` that the host's graphs trace through."""

    fxsurgery_internal = True  # not a hook an installed graph must honour (``hooked_submodules``)

    def __init__(self, host: nn.Module, host_name: str, name: str) -> None:
        self.host, self.host_name, self.name = host, host_name, name

    def __call__(self, module: nn.Module, args: tuple) -> None:
        if self.host.__dict__.get(SERVING, 0) or GraphForward.of(module) is not None:
            return
        why = outside_refusal(self.host)
        if why:
            raise UnservedCall(f"{self.name} ({type(module).__name__}) is called outside the forward of "
                               f"{self.host_name or 'the model'} ({type(self.host).__name__}), whose graphs serve "
                               f"its modules on the compact tensors; their own code {why}: call "
                               f"{self.host_name or 'the model'} itself")


def outside_refusal(host: nn.Module) -> str:
    """Why ``host``'s modules cannot run their own code on its compact tensors now ("" if they can)."""
    server = GraphForward.of(host).server
    if server is None:
        return "cannot be checked (nothing fits the host's own forward)"
    server.fit_own_forward()
    fit = server.fit
    if fit.fault:
        return fit.fault
    if fit.counts or fit.gathers:
        read = ", ".join(sorted({count.name for count in fit.counts})) or "module inputs through the units' indices"
        return f"reads {read}, which follow the widths only in the calls the host's forward serves"
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
            module.register_forward_pre_hook(OutsideCallGuard(host, host_name, f"{host_name}.{name}".strip(".")))
