"""Inlining wrapped helper functions into the host graph, so the counts they take become graph constants."""
from __future__ import annotations

import inspect
import operator
from typing import Any, Callable

import torch
import torch.fx

from ..compat import pytree_info, tree_leaves
from .tracer import Tracer, substitute

_OWN_PACKAGE = __name__.split(".")[0]


def _library_function(fn: Callable[..., Any]) -> bool:
    """torch's own functions and this package's (its decompositions' helpers) are never inlined."""
    return fn.__module__.split(".")[0] in ("torch", _OWN_PACKAGE)


def pack(value: Any) -> Any:
    """The structure a helper returned, as one graph value (its inlined body yields several nodes)."""
    return value


def inline_helpers(graph: torch.fx.Graph, kind_of: Callable[[torch.fx.Node], str]) -> bool:
    """Replace each call of a wrapped helper function whose non-tensor arguments are literals of the graph
    by its traced body, so counts it takes (``num_heads``) become the graph's own constants, rewritten on
    every edit. ``kind_of(node)`` says what a node held in a run: "tensor", "none" or "other". A helper that
    does not trace, or takes values computed at run time, stays a call. Returns whether anything was inlined."""
    changed = False
    for node in list(graph.nodes):
        fn = node.target
        if node.op != "call_function" or not inspect.isfunction(fn) or _library_function(fn):
            continue
        try:
            bound = inspect.signature(fn).bind(*node.args, **node.kwargs)
        except TypeError:
            continue
        bound.apply_defaults()
        arguments = {k: (None if isinstance(v, torch.fx.Node) and kind_of(v) == "none" else v)
                     for k, v in bound.arguments.items()}  # a node that was None at run time is None
        literal = {k: v for k, v in arguments.items() if not isinstance(v, torch.fx.Node)}
        if any(isinstance(v, torch.fx.Node) for v in tree_leaves(list(literal.values()))) or \
                any(kind_of(v) != "tensor" for v in arguments.values() if isinstance(v, torch.fx.Node)):
            continue
        try:
            body = Tracer().trace(fn, concrete_args=literal or None)
        except Exception:  # control flow on tensors: the call stays opaque (its inside is labelled when it can be)
            continue
        if pytree_info(body) is not None or any(n.op == "get_attr" for n in body.nodes):
            continue
        val_map = {}
        for p in (n for n in body.nodes if n.op == "placeholder"):
            name = p.target if p.target in bound.arguments else p.target.rpartition("_")[0]
            val_map[p] = arguments[name]
        with graph.inserting_before(node):
            out = graph.graph_copy(body, val_map)
        for copied in val_map.values():
            if isinstance(copied, torch.fx.Node) and "nn_module_stack" in node.meta:
                copied.meta.setdefault("nn_module_stack", node.meta["nn_module_stack"])
        if isinstance(out, torch.fx.Node):
            node.replace_all_uses_with(out)
        elif all(u.target is operator.getitem and u.args[0] is node and type(u.args[1]) is int for u in node.users):
            for u in list(node.users):  # unpacked at once: each part (a node, a literal, a list of sizes) in place
                substitute(u, out[u.args[1]])
        else:
            with graph.inserting_before(node):
                result = graph.call_function(pack, (out,))
            result.meta["nn_module_stack"] = node.meta.get("nn_module_stack", {})
            node.replace_all_uses_with(result)
        graph.erase_node(node)
        changed = True
    return changed
