"""Objects that hold tensors in a captured call's outputs (the key/value cache a decoder returns).

``torch.export`` flattens only the containers pytree knows and refuses any other object in a module's outputs. Each
other type found holding tensors in the outputs of the example call is registered as a pytree node while the module
is captured: flattened by its attributes (those that hold tensors or numbers are children, the rest context),
rebuilt from them without calling ``__init__``. The registration ends with the capture; the graph's output spec then
names ``HeldObject`` in place of each such type, a node fxsurgery keeps registered whose context names the type, so
the installed graph rebuilds the object as the module returned it. Its tensors are state at the units' widths (a
removed head's keys and values are gone from it), not outputs a removal must keep: the analysis does not pin them.
A call that passes such an object is no graph's (``without_objects``): the host's own forward serves it.
"""
from __future__ import annotations

import contextlib
import copy
from collections.abc import Mapping
from typing import Any, Iterator

import torch
import torch.fx
import torch.nn as nn

from ..compat import (
    is_pytree_node,
    pytree_info,
    pytree_node_registered,
    register_pytree_node,
    set_out_spec,
    spec_with_types,
)


class HeldObject:
    """The node type an installed graph's output spec names in place of a type registered for its capture only:
    its context (type, names of the children, other attributes) rebuilds the object."""


def _flatten(obj: Any) -> tuple[dict[str, Any], tuple]:
    """The attributes that hold tensors or numbers (a length the capture makes symbolic), by name; the type, their
    names and the other attributes as context."""
    held = {name: value for name, value in vars(obj).items() if _is_number(value) or _holds_tensors(value, set())}
    rest = {name: value for name, value in vars(obj).items() if name not in held}
    return held, (type(obj), tuple(held), rest)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float, torch.SymInt, torch.SymFloat)) and not isinstance(value, bool)


def _unflatten(children: list, context: tuple) -> Any:
    """An instance of the context's type with its attributes (other attributes copied: each call gets its own)."""
    cls, names, rest = context
    obj = cls.__new__(cls)
    vars(obj).update(copy.deepcopy(rest))
    vars(obj).update(zip(names, children))
    return obj


register_pytree_node(HeldObject, _flatten, _unflatten)


def _children(value: Any) -> list | None:
    """What a value holds: a container's items, an object's attributes (not a module's: its tensors are state, not
    values); None for anything else."""
    if isinstance(value, Mapping):
        return list(value.values())
    if isinstance(value, (list, tuple)):
        return list(value)
    if isinstance(value, (torch.Tensor, nn.Module, type)) or not hasattr(value, "__dict__"):
        return None
    return list(vars(value).values())


def _holds_tensors(value: Any, seen: set[int]) -> bool:
    if torch.is_tensor(value):
        return True
    if id(value) in seen:
        return False
    seen.add(id(value))
    return any(_holds_tensors(child, seen) for child in _children(value) or ())


def tensor_holders(value: Any) -> list[type]:
    """The types in ``value`` (at any depth) that pytree does not know and whose objects hold tensors."""
    found: dict[type, None] = {}
    seen: set[int] = set()

    def walk(item: Any) -> None:
        if id(item) in seen or torch.is_tensor(item):
            return
        seen.add(id(item))
        children = _children(item)
        if children is None:
            return
        if not isinstance(item, (Mapping, list, tuple)) and not is_pytree_node(type(item)) \
                and _holds_tensors(item, set()):
            found[type(item)] = None
        for child in children:
            walk(child)

    walk(value)
    return list(found)


@contextlib.contextmanager
def holders_registered(types: list[type]) -> Iterator[None]:
    """Each of ``types`` a pytree node (flattened by its attributes) while the block runs."""
    with contextlib.ExitStack() as stack:
        for cls in types:
            stack.enter_context(pytree_node_registered(cls, _flatten, _unflatten))
        yield


def held_output_leaves(graph: torch.fx.Graph) -> set[int]:
    """The positions, among the leaves ``graph`` returns, of those it returns inside a rebuilt object (a cache's
    keys and values): state at the widths of the units, which later calls hand back to the host's own forward."""
    info = pytree_info(graph)
    held: set[int] = set()

    def walk(spec: Any, start: int, inside: bool) -> int:
        if spec.is_leaf():
            if inside:
                held.add(start)
            return start + 1
        for child in spec.children():
            start = walk(child, start, inside or spec.type is HeldObject)
        return start

    if info is not None:
        walk(info.out_spec, 0, False)
    return held


def rebuild_held_outputs(graph: torch.fx.Graph, types: list[type]) -> None:
    """Make ``graph``'s output spec name ``HeldObject`` for each of ``types``: the graph then rebuilds those objects
    once their registration has ended."""
    info = pytree_info(graph)
    if info is not None and types:
        set_out_spec(graph, spec_with_types(info.out_spec, lambda t: HeldObject if t in types else t))
