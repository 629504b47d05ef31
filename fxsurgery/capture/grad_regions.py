"""Grad-mode regions of an exported graph, inlined so the analysis reads their ops like any others.

``torch.export`` records code under ``torch.no_grad()`` (a rotary embedding's tables, say) as a call of the
higher-order op ``wrap_with_set_grad_enabled`` on a graph module of its own. Its body is copied into the
graph between calls that set and restore the grad mode, so the graph still computes what the module does,
gradients included. Any other graph-valued attribute (another higher-order op) is refused, naming the node.
"""
from __future__ import annotations

import operator

import torch
import torch.fx

from ..compat import switch_grad_mode
from ..errors import TraceError

_SET_GRAD = torch.ops.higher_order.wrap_with_set_grad_enabled


def inline_grad_regions(root: torch.fx.GraphModule, graph: torch.fx.Graph) -> None:
    """Replace each ``wrap_with_set_grad_enabled`` call of ``graph`` (its bodies are attributes of ``root``)
    with its body, in place; raise ``TraceError`` on a graph module that another node reads."""
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is _SET_GRAD:
            _inline(root, graph, node)
    for node in graph.nodes:
        if node.op == "get_attr" and isinstance(getattr(root, node.target, None), torch.fx.GraphModule):
            users = ", ".join(f"{u.name} ({u.target})" for u in node.users)
            raise TraceError(f"{node.name}: a graph module called by {users or 'nothing'}: "
                             f"this higher-order op cannot be analysed")


def _inline(root: torch.fx.GraphModule, graph: torch.fx.Graph, node: torch.fx.Node) -> None:
    enabled, body_node, *inputs = node.args
    body = getattr(root, body_node.target).graph
    placeholders = [n for n in body.nodes if n.op == "placeholder"]
    with graph.inserting_before(node):
        before = graph.call_function(torch.is_grad_enabled)
        graph.call_function(switch_grad_mode, (enabled,))
        outputs = graph.graph_copy(body, dict(zip(placeholders, inputs)))
        graph.call_function(switch_grad_mode, (before,))
    for user in list(node.users):  # export unpacks the body's outputs by index
        if user.target is not operator.getitem or user.args[0] is not node:
            raise TraceError(f"{node.name}: its result is read by {user.name} ({user.target}), not by index")
        user.replace_all_uses_with(outputs[user.args[1]])
        graph.erase_node(user)
    graph.erase_node(node)
    if not body_node.users:
        graph.erase_node(body_node)
