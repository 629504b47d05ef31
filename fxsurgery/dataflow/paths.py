"""Dotted module paths: joining them, whether one lies within another, the module a graph node runs in, the deepest
module holding several paths, and the parameter or buffer a path names. Shared by the grouping, the softmax check in
``gates`` (which the grouping imports), the repeats, the analysis and the edits."""
from __future__ import annotations

from typing import Sequence

import torch
import torch.fx
import torch.nn as nn


def join_path(prefix: str, name: str) -> str:
    """Dotted module path ``prefix.name`` ("" stands for the root)."""
    return f"{prefix}.{name}" if prefix and name else prefix or name


def within(path: str, module: str) -> bool:
    """Module ``path`` is ``module`` or lies inside it ("" holds every module)."""
    return path == module or not module or path.startswith(module + ".")


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


def tensor_at(module: nn.Module, name: str) -> torch.Tensor:
    """The parameter or buffer of ``module`` at the dotted path ``name``."""
    try:
        return module.get_parameter(name)
    except AttributeError:
        return module.get_buffer(name)
