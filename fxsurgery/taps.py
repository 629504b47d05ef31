"""Tap points: where an installed graph hands a group's units to its output projection (and, for heads mixed by
heads×heads maps, to each map: a head enters the others there too).

The front ends call a projection in different ways (a Linear module, ``F.linear``, the ``addmm`` of a captured
Conv1D), and a captured host calls it inside its own graph, so a hook on the projection module would not see
every group. Instead each host graph passes the projection's input through the group's ``TapPoint``, a plain
attribute of the host, with the layout of the units there, and the taps registered there see it (and may change
it) on every front end, once per site.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable

import torch
import torch.fx
from torch.utils.hooks import RemovableHandle

from .dataflow.records import TapLayout

Tap = Callable[[torch.Tensor], None]
POINT_PREFIX = "_fxsurgery_tap"


class TapPoint:
    """The taps of one group; called by its host's graphs with the values that hand its units on (the output
    projection's input, a mixing map's input) and their layout there.

    Taps are live callbacks of a session: ``copy.deepcopy`` copies them along (like module hooks), pickling
    drops them."""

    def __init__(self) -> None:
        self.hooks: OrderedDict[int, Tap] = OrderedDict()
        # the hooks called only with values that require grad (an OrderedDict: a handle holds a weak reference to it)
        self.grad_only: OrderedDict[int, bool] = OrderedDict()

    def add(self, fn: Tap, *, grad_only: bool = False) -> RemovableHandle:
        handle = RemovableHandle(self.hooks, extra_dict=self.grad_only)
        self.hooks[handle.id] = fn
        if grad_only:
            self.grad_only[handle.id] = True
        return handle

    def active(self, grad: bool) -> list[Tap]:
        """The hooks that run for a value that does (``grad``) or does not require grad."""
        return [fn for key, fn in self.hooks.items() if grad or key not in self.grad_only]

    def __call__(self, x: torch.Tensor, layout: TapLayout) -> torch.Tensor:
        hooks = self.active(x.requires_grad)
        if not hooks:
            return x
        outer, inner, dim = layout
        y = x.movedim(dim, -1)
        y = y.unflatten(-1, (outer, y.shape[-1] // (outer * inner), inner))
        a = y.movedim(-3, -2).flatten(-2)  # (*lead, count, outer*inner): a view when outer is 1
        for fn in hooks:
            fn(a)
        y = a.unflatten(-1, (outer, inner)).movedim(-2, -3).flatten(-3)
        return y.movedim(-1, dim)  # the projection reads a: gradients reach it

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.hooks = OrderedDict()
        self.grad_only = OrderedDict()


def run_tap_point(point: TapPoint, x: torch.Tensor, layout: TapLayout) -> torch.Tensor:
    """The graph's call of a tap point (a module-level function, so generated code can name it)."""
    return point(x, layout)


def insert_tap_point(attr: str, sink: torch.fx.Node, source: torch.fx.Node, layout: TapLayout) -> None:
    """Route ``source`` into ``sink`` through the tap point that the host holds as ``attr``; the units lie in
    ``source`` as ``layout`` says."""
    graph = sink.graph
    with graph.inserting_before(sink):
        point = graph.create_node("get_attr", attr, name=attr)
        tapped = graph.create_node("call_function", run_tap_point, (point, source, tuple(layout)),
                                   name=f"{attr}_input")
    sink.replace_input_with(source, tapped)


def strip_tap_points(graph: torch.fx.Graph) -> torch.fx.Graph:
    """The graph without its tap points (each projection reads its input directly again)."""
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is run_tap_point:
            node.replace_all_uses_with(node.args[1])
            point = node.args[0]
            graph.erase_node(node)
            if not point.users:
                graph.erase_node(point)
    return graph
