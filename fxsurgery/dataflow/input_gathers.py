"""Tensors lined up with the heads that the code computes at the count it was built with and hands to the module
computing the attention logits (per-head ALiBi slopes made once by the model and passed to every attention layer).

Masking a head is well defined there, so the head is a unit: a compact layer must read its kept heads' entries of
the tensor, a clone its parent's entry again. The graph reads such a module input through ``gather_units``, by an
index buffer of that module (``arange`` of the count as analysed), in that module's uses only. The buffer is a
member of the heads' group along its dim 0, so every edit keeps it at the group's count: a removal drops the unit's
entry, a clone copies its parent's. It is persistent: the state_dict says which heads each layer reads. The host's
own forward, which serves calls no graph takes, applies the same gather to the module's argument
(``forward_gathered``).
"""
from __future__ import annotations

import functools
import inspect
import operator
from typing import Any, NamedTuple

import torch
import torch.fx
import torch.nn as nn

from ..reason import Reason
from .paths import join_path, module_of, within

INDEX_PREFIX = "unit_index_"  # a module's index buffers: unit_index_0, unit_index_1, ...
GATHERED_SHAPE = "fxsurgery_gathered_shape"  # a gather node's meta: the shape its input had on the analysed call


def gather_units(input: torch.Tensor, index: torch.Tensor, *, dim: int, size: int) -> torch.Tensor:
    """The entries ``index`` of each run of ``size`` along ``dim`` of ``input`` (the dim may hold a batch dim
    merged before the heads, B·H: the runs are its blocks, however many)."""
    return input.unflatten(dim, (-1, size)).index_select(dim + 1, index).flatten(dim, dim + 1)


class GatherSite(NamedTuple):
    """A value (graph node ``input``, of ``shape``) that module ``module`` takes in and lines up along ``dim`` with
    ``size`` heads, in runs (labelling's record)."""

    input: str
    module: str
    dim: int
    size: int
    shape: tuple[int, ...]


class Gather(NamedTuple):
    """A module input the installed graph reads through ``gather_units``, as the host's own forward must: argument
    ``argument`` of the forward of the host's module ``module`` ("" the host), read along ``dim`` in runs of ``size``
    by that module's index buffer ``index``."""

    module: str
    argument: str
    dim: int
    size: int
    index: str


# ops between a module input and its use that keep its dims (and its values, at the positions they keep)
_KEEPING_METHODS = ("contiguous", "clone", "detach", "float", "double", "half", "bfloat16", "to", "type", "type_as")


def module_input(node: torch.fx.Node, dim: int, module: str) -> torch.fx.Node | None:
    """The input of ``module`` that ``node`` (a value used in it) is, or reads through ops that keep ``dim`` whole
    (dtype moves, basic slicing that keeps every position of ``dim``): a placeholder, or a node outside the module
    (a whole model's graph; or a host's whose submodule computes the logits); None otherwise. The ops keep the dim's
    number."""
    while node.op != "placeholder" and within(module_of(node), module):
        if node.op == "call_method" and node.target in _KEEPING_METHODS:
            node = node.args[0]
        elif node.op == "call_function" and node.target is operator.getitem and _keeps(node.args[1], dim):
            node = node.args[0]
        else:
            return None
        if not isinstance(node, torch.fx.Node):
            return None
    return node


def _keeps(index: Any, dim: int) -> bool:
    """Basic indexing by slices alone that keeps every position of ``dim``."""
    index = index if isinstance(index, tuple) else (index,)
    if not all(isinstance(i, slice) for i in index):
        return False
    return dim >= len(index) or index[dim] == slice(None)


def insert_gathers(gm: torch.fx.GraphModule, sites: list[GatherSite]) -> bool:
    """Make each site's module read its input through ``gather_units`` by a new index buffer of that module
    (``arange`` of the size); False where there is none to insert (each input is gathered once per module)."""
    nodes = {n.name: n for n in gm.graph.nodes}
    sites = [site for site in dict.fromkeys(sites) if site.input in nodes]
    for site in sites:
        source = nodes[site.input]
        try:
            owner = gm.get_submodule(site.module)
        except AttributeError:  # a module the graph reads no attribute of: made to hold the buffer
            gm.add_submodule(site.module, nn.Module())
            owner = gm.get_submodule(site.module)
        read = [n.args[1].target for n in gm.graph.nodes if n.op == "call_function" and n.target is gather_units]
        k = sum(target.rpartition(".")[0] == site.module for target in read)  # named in the graph's order
        owner.register_buffer(f"{INDEX_PREFIX}{k}", torch.arange(site.size))
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]  # a gather of one follows them all
        with gm.graph.inserting_after(placeholders[-1] if source.op == "placeholder" else source):
            index = gm.graph.get_attr(join_path(site.module, f"{INDEX_PREFIX}{k}"))
        with gm.graph.inserting_after(index):
            gathered = gm.graph.call_function(gather_units, (source, index), {"dim": site.dim, "size": site.size})
        gathered.meta[GATHERED_SHAPE] = site.shape
        for user in [u for u in source.users if u is not gathered and within(module_of(u), site.module)]:
            user.replace_input_with(source, gathered)
    if sites:
        gm.recompile()
    return bool(sites)


def add_index_buffers(host: nn.Module, graphs: list[torch.fx.Graph], held: set[str]) -> None:
    """Give ``host``'s modules the index buffers the gathers in ``graphs`` read that they lack, with every unit as
    analysed, on the device of the host's parameters. One that no installed group holds (``held``: their tensors'
    names within the host), whose group failed its self-check, reads every unit for good: it stays out of the
    state_dict, which says only which units a layer's groups keep."""
    device = next(host.parameters(), torch.empty(0)).device
    for n in (n for graph in graphs for n in graph.nodes if n.op == "call_function" and n.target is gather_units):
        path, _, name = n.args[1].target.rpartition(".")
        owner = host.get_submodule(path)
        if name not in dict(owner.named_buffers(recurse=False)):
            owner.register_buffer(name, torch.arange(n.kwargs["size"], device=device),
                                  persistent=n.args[1].target in held)


def index_values(graph: torch.fx.Graph) -> dict[str, torch.Tensor]:
    """The index buffers the gathers of ``graph`` read (named within its module), each with every unit as analysed:
    what a model whose values were lost (made on the meta device, then ``to_empty``) must hold again there."""
    return {n.args[1].target: torch.arange(n.kwargs["size"]) for n in graph.nodes
            if n.op == "call_function" and n.target is gather_units}


def argument_gathers(host: nn.Module, graph: torch.fx.Graph, call: tuple[tuple, dict]) -> list[Gather] | Reason:
    """The gathers of ``graph`` as arguments of the modules they feed, told by running ``host`` (a copy at the
    analysed widths, whose own forward it runs) on the call the graph was analysed on: the one argument of each
    module's first call holding a tensor of the shape the graph's input had. What cannot be told, if any."""
    nodes = [n for n in graph.nodes if n.op == "call_function" and n.target is gather_units]
    if not nodes:
        return []
    calls: dict[str, dict[str, Any]] = {}

    def recorder(path: str) -> Any:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if path not in calls:
                calls[path] = inspect.signature(type(module).forward).bind(module, *args, **kwargs).arguments
        return hook
    paths = {n.args[1].target.rpartition(".")[0] for n in nodes}
    handles = [host.get_submodule(path).register_forward_pre_hook(recorder(path), with_kwargs=True)
               for path in paths]
    try:
        with torch.no_grad():
            host(*call[0], **call[1])
    except Exception as e:  # any failure: the own forward cannot be fitted
        return Reason(f"cannot run the call it was analysed on ({type(e).__name__})")
    finally:
        for handle in handles:
            handle.remove()
    gathers = []
    for n in nodes:
        path, _, index = n.args[1].target.rpartition(".")
        shape = n.meta.get(GATHERED_SHAPE)
        names = [k for k, v in calls.get(path, {}).items() if torch.is_tensor(v) and tuple(v.shape) == shape]
        if len(names) != 1:
            return Reason(f"cannot tell which argument of {path or 'the host'} it reads through {n.name} "
                          f"({len(names)} of shape {shape})", module=path, node=n.name)
        gathers.append(Gather(path, names[0], n.kwargs["dim"], n.kwargs["size"], index))
    return gathers


def forward_gathered(module: nn.Module, gathers: list[Gather], args: tuple, kwargs: dict) -> Any:
    """The class's forward of ``module`` on the call, each gathered argument read through its index buffer as the
    installed graph reads it (the host's own, and through pre-hooks those of the modules inside it)."""
    handles = [module.get_submodule(g.module).register_forward_pre_hook(functools.partial(_gathered, [g]),
                                                                        with_kwargs=True)
               for g in gathers if g.module]
    try:
        args, kwargs = _gathered([g for g in gathers if not g.module], module, args, kwargs)
        return type(module).forward(module, *args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()


def _gathered(gathers: list[Gather], module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``module``'s call with each of ``gathers`` applied to its argument."""
    if not gathers:
        return args, kwargs
    bound = inspect.signature(type(module).forward).bind(module, *args, **kwargs)
    for g in gathers:
        value = bound.arguments.get(g.argument)
        if value is not None:
            bound.arguments[g.argument] = gather_units(value, module.get_buffer(g.index), dim=g.dim, size=g.size)
    return bound.args[1:], bound.kwargs
