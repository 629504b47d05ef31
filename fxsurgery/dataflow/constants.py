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

    def __deepcopy__(self, memo: dict) -> "ConstantSpec":
        """The node's copy where this deep copy copied its graph already (a graph's copy maps its nodes in the memo),
        else the same node: copied alone, a node drags its every input along, a recursion as deep as the graph is
        long (the record only names the node once the host is installed: ``bind_constants`` made it a read)."""
        return ConstantSpec(memo.get(id(self.node), self.node), self.path, self.per_unit)

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
        product = self.read_times_literal(value)
        folded = product is not None and not self.reads_unit_axis(product[0])  # heads folded into the batch
        if isinstance(value, Node) and value not in self.size_reads and (product is None or folded):
            if folded and product[2] % self.count == 0:  # ``B * num_heads``: the literal follows the count
                return ConstantSpec(value, ("args", product[1]), product[2] // self.count)
            raise Unsupported(f"{self.node.name}: the size on the unit axis is computed by {value.name}; "
                              "cannot rewrite it")
        if isinstance(value, int) and value not in (-1, size):
            raise Unsupported(f"{self.node.name}: argument {value} does not match unit-axis size {size}")
        return ConstantSpec(self.node, path, size // self.count)

    def read_times_literal(self, value: Any) -> tuple[Node, int, int] | None:
        """(the size, the literal's position, the literal) where ``value`` is ``size * literal`` with ``size`` read
        at run time; None otherwise. Either factor may follow the count: the literal (``B * num_heads``), or the
        size, read along the unit axis (``num_key_value_heads * n_rep``: the whole product is then rewritten)."""
        if not (isinstance(value, Node) and value.op == "call_function" and value.target is operator.mul):
            return None
        literals = [k for k, a in enumerate(value.args) if isinstance(a, int) and not isinstance(a, bool)]
        if len(value.args) != 2 or len(literals) != 1 or value.args[1 - literals[0]] not in self.size_reads:
            return None
        k = literals[0]
        return value.args[1 - k], k, value.args[k]

    def reads_unit_axis(self, value: Any) -> bool:
        """``value`` is a size read, at run time, of a tensor's own unit axis: it follows the count by itself."""
        if not isinstance(value, Node) or value not in self.size_reads or value.op != "call_function":
            return False
        if value.target is not operator.getitem or not isinstance(value.args[0], Node):
            return False
        shape = value.args[0]
        source = shape.args[0] if shape.op == "call_function" and shape.target is getattr else None
        return isinstance(source, Node) and self.axes.get((source, None)) == value.args[1]


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
