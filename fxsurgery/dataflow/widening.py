"""Following a size-1 dim through a graph: ids cannot vary along a dim of size 1, so the one head of a
single-head layer is found by widening. Each node reached is run on meta tensors whose widened dims have a
size no real dim has; the dim of its output that changed size is where the widened dim went."""
from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.fx
from torch.fx.node import Node, map_arg

from ..capture.calls import meta_state
from ..reason import Reason

Key = tuple  # (node, output index or None)


class Widened(NamedTuple):
    """Where the widened dim lies in each value it reached, and the nodes it could not pass (why)."""

    axes: dict[Key, int]
    failures: dict[Node, str]


def wide_size(shapes: dict[Node, Any]) -> int:
    """A size larger than every dim of the graph's values, so a widened dim never broadcasts by chance."""
    sizes = [s for shape in shapes.values() for s in _flat_sizes(shape)]
    return max(sizes + [1]) + 1


def _flat_sizes(shape: Any) -> list[int]:
    if shape and isinstance(shape[0], tuple):
        return [s for sub in shape for s in sub]
    return list(shape)


def widen(gm: torch.fx.GraphModule, shapes: dict[Node, Any], dtypes: dict[Node, Any], values: dict[Node, Any],
          seeds: dict[Node, int]) -> Widened:
    """Run every node downstream of ``seeds`` (node -> dim of its value made wide) on meta tensors of the
    recorded shapes."""
    width = wide_size(shapes)
    env: dict[Node, Any] = {}
    axes: dict[Key, int] = {}
    failures: dict[Node, str] = {}

    def plain(a: Node) -> Any:
        if a in env:
            return env[a]
        if a in shapes:
            shape, dtype = shapes[a], dtypes[a]
            if shape and isinstance(shape[0], tuple):
                return tuple(torch.empty(s, dtype=d, device="meta") for s, d in zip(shape, dtype))
            return torch.empty(shape, dtype=dtype, device="meta")
        if a in values:
            return values[a]
        raise KeyError(f"no recorded value for {a.name}")

    for node in gm.graph.nodes:
        reached = any(a in env for a in node.all_input_nodes)
        if node in seeds:
            shape = list(shapes[node])
            shape[seeds[node]] = width
            env[node] = torch.empty(shape, dtype=dtypes[node], device="meta")
            axes[(node, None)] = seeds[node]
            continue
        if node.op == "output" or not reached:
            continue
        try:
            out = _run(gm, node, map_arg(node.args, plain), map_arg(node.kwargs, plain))
        except Exception as e:  # the widened dim cannot pass this node
            failures[node] = f"{node.name}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            continue
        real = shapes.get(node)
        if torch.is_tensor(out) and real is not None:
            why = _follow(out, real, node, None, axes)
            if why:
                failures[node] = f"{node.name}: {why.text}"
            else:
                env[node] = out
        elif isinstance(out, (tuple, list)) and out and all(torch.is_tensor(o) for o in out) and real:
            whys = [_follow(o, r, node, i, axes) for i, (o, r) in enumerate(zip(out, real))]
            if any(whys):
                failures[node] = f"{node.name}: {next(w for w in whys if w).text}"
            else:
                env[node] = tuple(out)
    return Widened(axes, failures)


def _follow(out: torch.Tensor, real: tuple, node: Node, index: int | None, axes: dict[Key, int]) -> Reason | None:
    """Record the one dim of ``out`` that grew; or why there is none."""
    if out.dim() != len(real):
        return Reason("the widened value changes rank", node=node.name)
    grown = [d for d in range(out.dim()) if out.shape[d] != real[d]]
    if len(grown) != 1:
        return Reason("no dim of its output follows the head axis" if not grown else
                      f"the head axis spreads over dims {grown}", node=node.name)
    axes[(node, index)] = grown[0]
    return None


def _run(gm: torch.fx.GraphModule, node: Node, args: tuple, kwargs: dict) -> Any:
    if node.op == "call_function":
        return node.target(*args, **kwargs)
    if node.op == "call_method":
        return getattr(args[0], node.target)(*args[1:], **kwargs)
    if node.op == "call_module":
        mod = gm.get_submodule(node.target)
        return torch.func.functional_call(mod, meta_state(mod), args, kwargs)
    raise TypeError(f"{node.op} cannot be widened")
