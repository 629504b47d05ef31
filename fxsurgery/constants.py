"""Graph constants whose value depends on a group's unit count.

For each node whose input or output carries the unit axis, a small rule finds the literal (or size
read, or ``-1``) in its arguments that spans that axis. The value is recorded as units × per-unit size
and rewritten on every count change.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.fx.node import Node

from .rules import index_dims

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

    def follows_units(self, shape: Node) -> bool:
        """``shape`` is the full size of a tensor whose unit axis sits where the output's does, so
        it follows the count by itself (e.g. ``x.reshape(y.shape)``)."""
        n = shape
        is_read = (n.op == "call_function" and n.target is getattr and n.args[1] == "shape") or \
                  (n.op == "call_method" and n.target == "size" and len(n.args) == 1)
        return is_read and isinstance(n.args[0], Node) and self.axes.get((n.args[0], None)) == self.out_dim

    def constant(self, path: Path, size: int) -> ConstantSpec:
        """The argument at ``path`` spans ``size`` elements of the unit axis."""
        if size % self.count:
            raise Unsupported(f"{self.node.name}: size {size} on the unit axis is not a multiple of {self.count} units")
        value = get_path(self.node, path)
        if isinstance(value, Node) and value not in self.size_reads:
            raise Unsupported(f"{self.node.name}: the size on the unit axis is computed by {value.name}; cannot rewrite it")
        if isinstance(value, int) and value not in (-1, size):
            raise Unsupported(f"{self.node.name}: argument {value} does not match unit-axis size {size}")
        return ConstantSpec(self.node, path, size // self.count)


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


def view(site: Site) -> list[ConstantSpec]:
    if site.out_dim is None:
        return []
    paths = shape_paths(site.node, 1)
    shape = site.node.args[1] if len(site.node.args) == 2 else None
    if not paths and isinstance(shape, Node) and site.follows_units(shape):
        return []
    if len(paths) != len(site.out_shape):
        raise Unsupported(f"{site.node.name}: shape built at run time; cannot rewrite the unit axis")
    return [site.constant(paths[site.out_dim], site.out_shape[site.out_dim])]


def expand(site: Site) -> list[ConstantSpec]:
    if site.out_dim is None:
        return []
    paths = shape_paths(site.node, 1)
    if get_path(site.node, paths[site.out_dim]) == -1:
        return []
    return view(site)


def unflatten(site: Site) -> list[ConstantSpec]:
    if site.out_dim is None or site.in_dim is None:
        return []
    dim = site.node.args[1] % len(site.in_shape)
    if site.in_dim != dim:
        return []
    k = site.out_dim - dim
    return [site.constant(("args", 2, k), site.out_shape[site.out_dim])]


def split(site: Site) -> list[ConstantSpec]:
    if site.in_dim is None:
        return []
    n = site.node
    dim = (n.args[2] if len(n.args) > 2 else n.kwargs.get("dim", 0)) % len(site.in_shape)
    if dim != site.in_dim:
        return []
    sizes = n.args[1] if len(n.args) > 1 else n.kwargs.get("split_size_or_sections", n.kwargs.get("split_size"))
    if isinstance(sizes, int) or isinstance(sizes, Node):
        return [site.constant(("args", 1), _int(site, sizes))]
    return [site.constant(("args", 1, k), _int(site, v)) for k, v in enumerate(sizes)]


def _int(site: Site, v: Any) -> int:
    if isinstance(v, Node):
        raise Unsupported(f"{site.node.name}: split size computed at run time on the unit axis")
    return v


def getitem(site: Site) -> list[ConstantSpec]:
    if site.in_dim is None:
        return []
    idx = site.node.args[1]
    entries = index_dims(idx, len(site.in_shape))
    out = []
    for k, (d, e) in enumerate(entries):
        if d != site.in_dim:
            continue
        if isinstance(e, slice):
            if e.step not in (None, 1):
                raise Unsupported(f"{site.node.name}: strided slice on the unit axis")
            base = ("args", 1, k) if isinstance(idx, tuple) else ("args", 1)
            for part in ("start", "stop"):
                v = getattr(e, part)
                if v is None or v == 0:
                    continue
                if isinstance(v, int) and v < 0:
                    raise Unsupported(f"{site.node.name}: negative slice bound on the unit axis")
                out.append(site.constant(base + (part,), v if isinstance(v, int) else site.values[v]))
        elif e is not None:
            raise Unsupported(f"{site.node.name}: indexing picks single positions on the unit axis")
    return out


def narrow(site: Site) -> list[ConstantSpec]:
    if site.in_dim is None:
        return []
    dim = site.node.args[1] % len(site.in_shape)
    if dim != site.in_dim:
        return []
    return [site.constant(("args", 2), site.node.args[2]), site.constant(("args", 3), site.node.args[3])]


def layer_norm(site: Site) -> list[ConstantSpec]:
    if site.in_dim is None:
        return []
    shape = site.node.args[1]
    first = len(site.in_shape) - len(shape)
    if site.in_dim < first:
        return []
    return [site.constant(("args", 1, site.in_dim - first), site.in_shape[site.in_dim])]


def no_constants(site: Site) -> list[ConstantSpec]:
    return []


FUNCTIONS: dict[Any, Callable[[Site], list[ConstantSpec]]] = {
    torch.reshape: view, torch.split: split, operator.getitem: getitem, torch.narrow: narrow,
    F.layer_norm: layer_norm, F.rms_norm: layer_norm, torch.unflatten: unflatten,
}
METHODS: dict[str, Callable[[Site], list[ConstantSpec]]] = {
    "view": view, "reshape": view, "expand": expand, "split": split, "narrow": narrow, "unflatten": unflatten,
}
def find(site: Site) -> list[ConstantSpec]:
    n = site.node
    if n.op == "call_function":
        rule = FUNCTIONS.get(n.target, no_constants)
    elif n.op == "call_method":
        rule = METHODS.get(n.target, no_constants)
    else:
        rule = no_constants
    return rule(site)
