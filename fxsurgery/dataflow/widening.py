"""Following a dim through a graph on meta tensors.

Forward, by widening: ids cannot vary along a dim of size 1, so the one head of a single-head layer is found by
widening. Each node reached is run on meta tensors whose widened dims have a size no real dim has; the dim of its
output that changed size is where the widened dim went.

Back, along a repeat: a value that units read alike, repeated to their count (``SharedRead``: one key/value head
expanded to every query head), carries none of their coordinates, so no unit axis reaches it by its ids; yet the
size of the repeat is the number of units, and must follow it. From the value the contraction reads, that dim is
followed back node by node (where each node's input dim went is told by running it on an input of contiguous
layout and matching strides) to the node that makes it from a size-1 dim (an expand, whose output repeats it with
stride 0); through a concatenation along another dim (the units' own coordinates beside a part they read alike:
latent attention's keys), into the parts that carry none of their ids. Each value on the way holds the units' axis
there: the constant rules then find its sizes as they do for any value that carries the units.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.fx
from torch.fx.node import Node, map_arg

from ..capture.calls import meta_state
from ..reason import Reason
from .constants import Unsupported
from .ids import align, varies
from .labeller import Labeller
from .records import SharedRead

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
            out = run_node(gm, node, map_arg(node.args, plain), map_arg(node.kwargs, plain))
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


def run_node(gm: torch.fx.GraphModule, node: Node, args: tuple, kwargs: dict) -> Any:
    """``node``'s op on the given arguments (a module's on meta copies of its parameters)."""
    if node.op == "call_function":
        return node.target(*args, **kwargs)
    if node.op == "call_method":
        return getattr(args[0], node.target)(*args[1:], **kwargs)
    if node.op == "call_module":
        mod = gm.get_submodule(node.target)
        return torch.func.functional_call(mod, meta_state(mod), args, kwargs)
    raise TypeError(f"{node.op} cannot be run on meta tensors")


def repeat_axes(lab: Labeller, read: SharedRead) -> dict[Key, int]:
    """The dim of each value, from the node that makes ``read``'s repeated dim up to the value the contraction
    reads (``lab``: the labelling that recorded it); none where that dim has size 1 (it broadcasts)."""
    if read.node is None:
        raise Unsupported(f"{read.at}: an operand its units read alike, inside an opaque call: where its size along "
                          "their axis is set cannot be told")
    if lab.shapes[read.node][read.dim] == 1:
        return {}
    axes: dict[Key, int] = {}
    todo = [(read.node, read.dim)]
    while todo:
        node, dim = todo.pop()
        axes[(node, None)] = dim
        if (parts := _parts_read_alike(lab, node, dim)) is not None:
            todo += [(part, dim) for part in parts]
            continue
        sources = [a for a in node.all_input_nodes if a in lab.shapes]
        if node.op not in ("call_function", "call_method", "call_module") or len(sources) != 1:
            raise Unsupported(f"{read.at}: {node.name} holds an operand its units read alike, repeated to their "
                              "count; where that size is set cannot be told (no single input to follow it to)")
        if (source_dim := _input_dim(lab, node, sources[0], dim)) is not None:
            todo.append((sources[0], source_dim))
    chain = {n for n, _ in axes}
    for n in chain - {read.node}:
        if any(u not in chain for u in n.users):
            raise Unsupported(f"{read.at}: {n.name}, an operand its units read alike repeated to their count, is "
                              "read elsewhere too")
    return axes


def _parts_read_alike(lab: Labeller, node: Node, dim: int) -> list[Node] | None:
    """Where ``node`` concatenates along another dim than ``dim`` (the units' own coordinates beside a part they
    read alike): the parts whose ids do not vary along ``dim``, which hold it at the same dim; None for any other
    node."""
    if node.op != "call_function" or node.target not in (torch.cat, torch.concat) or not node.args:
        return None
    rank = len(lab.shapes[node])
    along = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    if not isinstance(along, int) or along % rank == dim:
        return None
    parts = [a for a in node.args[0] if isinstance(a, Node)]
    labels = [lab.labels.get(a) for a in parts]
    return [a for a, label in zip(parts, labels)
            if label is None or not varies(align(label.ids, rank), dim)]


def _repeats_size_one(source: torch.Size, out: torch.Size, dim: int) -> bool:
    """Whether ``out`` is ``source`` with its size-1 dim ``dim`` repeated, every other dim as it was."""
    return len(source) == len(out) and source[dim] == 1 and out[dim] > 1 and \
        all(a == b for k, (a, b) in enumerate(zip(source, out)) if k != dim)


def _input_dim(lab: Labeller, node: Node, source: Node, dim: int) -> int | None:
    """The dim of ``source`` that ``node`` puts at its output dim ``dim``; None where ``node`` makes that dim by
    repeating a size-1 dim of ``source`` (a broadcast view, such as an expand)."""
    def plain(a: Node) -> Any:
        return torch.empty(lab.shapes[a], dtype=lab.dtypes[a], device="meta") if a in lab.shapes else lab.values[a]
    try:
        shape = lab.shapes[source]  # a view into a padded block: every dim has a stride of its own, which no copy's has
        probe = torch.empty([size + 1 for size in shape], dtype=lab.dtypes[source], device="meta")[
            tuple(slice(0, size) for size in shape)]
        out = run_node(lab.module, node, map_arg(node.args, lambda a: probe if a is source else plain(a)),
                       map_arg(node.kwargs, lambda a: probe if a is source else plain(a)))
    except Exception as e:  # any failure: the node cannot be followed
        raise Unsupported(f"{node.name}: cannot be followed back along a repeated axis ({type(e).__name__})") from e
    if not torch.is_tensor(out) or out.dim() <= dim or out.shape[dim] != lab.shapes[node][dim]:
        raise Unsupported(f"{node.name}: cannot be followed back along a repeated axis")
    if out.stride(dim) == 0:
        return None
    same = [i for i in range(probe.dim()) if probe.stride(i) == out.stride(dim) and probe.shape[i] == out.shape[dim]]
    if not same and _repeats_size_one(probe.shape, out.shape, dim):
        return None  # a copy that repeats a size-1 dim (``repeat_interleave``): the size is set here
    if not same:
        raise Unsupported(f"{node.name}: where its dim {dim}, which repeats an operand its units read alike, comes "
                          "from cannot be told")
    return same[0]
