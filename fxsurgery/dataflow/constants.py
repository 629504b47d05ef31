"""Graph constants whose value depends on a group's unit count.

For each node whose input or output carries the unit axis, the hook its op family registers on the
rule table finds the literal (or size read, or ``-1``) in its arguments that spans that axis. The value
is recorded as units × per-unit size and rewritten on every count change.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.fx.node import Node

Path = tuple  # ("args" | "kwargs", key, [inner index, ["start" | "stop"]])


@dataclass
class ConstantSpec:
    """One argument of one node that is ``per_unit`` × the unit count."""

    node: Node
    path: Path
    per_unit: int

    def describe(self) -> str:
        where = ".".join(str(p) for p in self.path[1:])
        return f"{self.node.name}[{where}] = {self.per_unit}·n"


class Unsupported(Exception):
    """A node spans the unit axis in a way no rule rewrites."""


def get_path(node: Node, path: Path) -> Any:
    obj = node.args if path[0] == "args" else node.kwargs
    for key in path[1:]:
        obj = getattr(obj, key) if isinstance(key, str) and isinstance(obj, slice) else obj[key]
    return obj


def set_path(node: Node, path: Path, value: Any) -> None:
    """Replace the argument at ``path`` (args and shapes are immutable tuples: rebuild them)."""
    def rebuilt(obj: Any, keys: tuple) -> Any:
        if not keys:
            return value
        key, rest = keys[0], keys[1:]
        if isinstance(obj, slice):
            parts = {"start": obj.start, "stop": obj.stop, "step": obj.step}
            parts[key] = rebuilt(parts[key], rest)
            return slice(parts["start"], parts["stop"], parts["step"])
        if isinstance(obj, dict):
            return {**obj, key: rebuilt(obj[key], rest)}
        items = list(obj)
        items[key] = rebuilt(items[key], rest)
        return type(obj)(items) if not isinstance(obj, torch.Size) else tuple(items)

    if path[0] == "args":
        node.args = rebuilt(node.args, path[1:])
    else:
        node.kwargs = rebuilt(node.kwargs, path[1:])


@dataclass
class Site:
    """What a constant rule sees: the node, the unit axis of its first input and of its output."""

    node: Node
    in_dim: int | None
    out_dim: int | None
    in_shape: tuple | None
    out_shape: Any
    count: int
    size_reads: set
    values: dict  # concrete non-tensor values of nodes (sizes read at run time)
    axes: dict  # (node, output index) -> unit axis, for every value that carries the units
    notes: list[str] = field(default_factory=list)  # why the group needs at least one unit
    in_ids: torch.Tensor | None = None  # the first input's ids (where it carries coordinates)
    # (start, stop) of the first input's unit axis that the units fill, where other coordinates lie beside them
    in_segment: tuple[int, int] | None = None
    segment_read: bool = False  # the hook placed its constants by ``in_segment``

    def input_segment(self) -> tuple[int, int] | None:
        """``in_segment``, read by a hook that places its constants by it."""
        self.segment_read = True
        return self.in_segment

    def follows_units(self, shape: Node) -> bool:
        """``shape`` is the full size of a tensor whose unit axis sits where the output's does, so
        it follows the count by itself (e.g. ``x.reshape(y.shape)``)."""
        n = shape
        is_read = (n.op == "call_function" and n.target is getattr and n.args[1] == "shape") or \
                  (n.op == "call_method" and n.target == "size" and len(n.args) == 1)
        return is_read and isinstance(n.args[0], Node) and self.axes.get((n.args[0], None)) == self.out_dim

    def write_size(self, path: Path, size: int) -> None:
        """Write in the size an inferred argument (``-1``) stands for, which does not follow the count."""
        set_path(self.node, path, size)

    def write_size_product(self, path: Path, source: Node, dims: list[int]) -> None:
        """Write in, for an inferred argument (``-1``), the product of ``source``'s sizes along ``dims``, read at
        run time: sizes that follow the batch and token counts, not the unit count."""
        graph = self.node.graph
        with graph.inserting_before(self.node):
            value = None
            for d in dims:
                size = graph.call_method("size", (source, d))
                value = size if value is None else graph.call_function(operator.mul, (value, size))
        set_path(self.node, path, value)

    def constant(self, path: Path, size: int) -> ConstantSpec:
        """The argument at ``path`` spans ``size`` elements of the unit axis."""
        if size % self.count:
            raise Unsupported(f"{self.node.name}: size {size} on the unit axis is not a multiple of {self.count} units")
        value = get_path(self.node, path)
        scaled = self.scaled_literal(value)
        if scaled is not None:
            return scaled
        if isinstance(value, Node) and value not in self.size_reads:
            raise Unsupported(f"{self.node.name}: the size on the unit axis is computed by {value.name}; "
                              "cannot rewrite it")
        if isinstance(value, int) and value not in (-1, size):
            raise Unsupported(f"{self.node.name}: argument {value} does not match unit-axis size {size}")
        return ConstantSpec(self.node, path, size // self.count)


    def scaled_literal(self, value: Any) -> ConstantSpec | None:
        """``size * k`` with ``k`` a literal multiple of the count and ``size`` read at run time (heads folded
        into the batch, ``B * num_heads``): the literal is what follows the count."""
        if not (isinstance(value, Node) and value.op == "call_function" and value.target is operator.mul):
            return None
        literals = [k for k, a in enumerate(value.args) if isinstance(a, int) and not isinstance(a, bool)]
        if len(value.args) != 2 or len(literals) != 1 or not isinstance(value.args[1 - literals[0]], Node):
            return None
        k = literals[0]
        literal = value.args[k]
        if literal % self.count or value.args[1 - k] not in self.size_reads:
            return None
        return ConstantSpec(value, ("args", k), literal // self.count)


def shape_paths(node: Node, first: int) -> list[Path]:
    """Paths of the shape entries of view/reshape/expand-style calls (varargs or one sequence)."""
    args = node.args
    if len(args) == first + 1 and isinstance(args[first], (tuple, list, torch.Size)):
        return [("args", first, k) for k in range(len(args[first]))]
    if "shape" in node.kwargs or "size" in node.kwargs:
        key = "shape" if "shape" in node.kwargs else "size"
        return [("kwargs", key, k) for k in range(len(node.kwargs[key]))]
    if len(args) == first + 1 and isinstance(args[first], Node):
        return []
    return [("args", k) for k in range(first, len(args))]
