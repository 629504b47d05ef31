"""Module paths of graph nodes: the module a node runs in, and the deepest module holding several paths. Shared by
the grouping, the softmax check in ``gates`` (which the grouping imports) and the analysis."""
from __future__ import annotations

from typing import Sequence

import torch.fx


def common_module(paths: Sequence[str]) -> str:
    """Deepest module that contains every path (dotted names)."""
    parts = [p.split(".") if p else [] for p in paths]
    if not parts:
        return ""
    out = []
    for level in zip(*parts):
        if len(set(level)) != 1:
            break
        out.append(level[0])
    return ".".join(out)


def module_of(node: torch.fx.Node) -> str:
    if node.op in ("call_module",):
        return node.target
    stack = node.meta.get("nn_module_stack")
    if stack:
        return list(stack.values())[-1][0]
    return ""
