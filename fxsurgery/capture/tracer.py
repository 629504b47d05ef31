"""torch.fx tracing of whole models, of the submodules that host units, and of plain helper functions."""
from __future__ import annotations

import bisect
import copy
import dis
import functools
import importlib
import importlib.util
import inspect
import operator
import sys
import types
from typing import Any, Callable, Iterator, NamedTuple

import torch
import torch.fx
import torch.nn as nn

from ..compat import graph_module, pytree_info, tree_leaves, tree_map
from ..errors import TraceError
from ..lru import LruCache
from ..runtime.graph_forward import GraphForward
from ..taps import strip_tap_points
from .calls import training_mode
from .decompositions import DECOMPOSITIONS

# torch.fx names the tensors a traced module's code made (not its parameters or buffers) so; the capture too
CODE_CONSTANT = "_tensor_constant"
# a symbolic trace's ``GraphModule.meta`` key: each module's first call in the trace, (args, kwargs) with nodes
MODULE_CALLS = "fxsurgery_module_calls"


def tracer_options() -> tuple[tuple[type, ...], tuple[Any, ...]]:
    """Leaf module types and autowrap functions that timm registers, when timm is installed."""
    if importlib.util.find_spec("timm") is None:
        return (), ()
    layers = importlib.import_module("timm.layers")
    return tuple(layers.get_notrace_modules()), tuple(layers.get_notrace_functions())


class _Proxy(torch.fx.Proxy):
    """A proxy that records item assignment (``attn[:, :, 1:, 1:] = ...``) as an ``operator.setitem`` node."""

    def __setitem__(self, index: Any, value: Any) -> None:
        self.tracer.create_proxy("call_function", operator.setitem, (self, index, value), {})

    def __iter__(self) -> Iterator[torch.fx.Proxy]:
        """fx's unpacking (``q, k, v = qkv.unbind(0)`` gives as many proxies as the caller unpacks), reading each
        calling function's bytecode once, where fx reads it again at every unpacking (every block of a model)."""
        caller = inspect.currentframe().f_back
        offsets, found = _instructions(caller.f_code)
        at = bisect.bisect_left(offsets, caller.f_lasti) if sys.version_info >= (3, 11) else caller.f_lasti // 2
        if found[at].opname == "UNPACK_SEQUENCE":
            return (self[i] for i in range(found[at].argval))
        return self.tracer.iter(self)

    def __getattr__(self, name: str) -> torch.fx.proxy.Attribute:
        return _Attribute(self, name)  # as fx's, unpacked as above (``B, N, C = x.shape``)


class _Attribute(torch.fx.proxy.Attribute):
    """fx's proxy of an attribute read (``x.shape``), unpacked as ``_Proxy`` unpacks."""

    __iter__ = _Proxy.__iter__


@functools.lru_cache(maxsize=1024)
def _instructions(code: types.CodeType) -> tuple[list[int], list[dis.Instruction]]:
    """The offsets and instructions of a function's bytecode."""
    found = list(dis.get_instructions(code))
    return [inst.offset for inst in found], found


_PLAIN_ARGUMENTS = (int, float, bool, str, type(None))


class Tracer(torch.fx.Tracer):
    """A symbolic tracer that keeps registered leaf modules opaque, traces torch.nn modules that have
    parts of their own through (their decomposition where they have one), and drops what a decomposition
    computed that nobody reads (attention weights a caller discards)."""

    def __init__(self) -> None:
        leaves, functions = tracer_options()
        super().__init__(autowrap_functions=tuple(f for f in functions if inspect.isfunction(f)))
        self.leaf_types = leaves
        self.decomposing = 0
        self.decomposed: list[torch.fx.Node] = []
        self._names_of: nn.Module | None = None  # the root whose tensor names ``_tensor_names`` holds
        self._names: tuple[dict[int, str], dict[int, str]] = ({}, {})
        self.module_calls: dict[str, tuple[tuple, dict]] = {}  # each module's first call: (args, kwargs), proxies

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        if type(m) in DECOMPOSITIONS:
            return False
        if isinstance(m, self.leaf_types):
            return True
        return super().is_leaf_module(m, qualname) and next(m.children(), None) is None

    def call_module(self, m: nn.Module, forward: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        self.module_calls.setdefault(self.path_of_module(m), (args, kwargs))
        decomposition = DECOMPOSITIONS.get(type(m))
        if decomposition is None:
            return super().call_module(m, forward, args, kwargs)
        self.decomposing += 1
        try:
            return super().call_module(m, functools.partial(decomposition, m), args, kwargs)
        finally:
            self.decomposing -= 1

    def create_arg(self, a: Any) -> Any:
        """fx's, with its most common arguments (proxies, plain numbers and strings) answered first: fx asks every
        argument whether it is a parameter, a tensor or a module before it gets to them."""
        if isinstance(a, torch.fx.Proxy):
            return a.node
        if type(a) in _PLAIN_ARGUMENTS:
            return a
        if type(a) is tuple:  # a call's arguments
            return tuple(self.create_arg(v) for v in a)
        if type(a) is dict and all(type(k) is str for k in a):  # a call's keyword arguments
            return {k: self.create_arg(v) for k, v in a.items()}
        return super().create_arg(a)

    def proxy(self, node: torch.fx.Node) -> torch.fx.Proxy:
        return _Proxy(node, self)

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: dict[str, Any]) -> Any:
        """fx's read of a module attribute (a parameter or buffer of the root becomes a ``get_attr`` proxy, once per
        name), with the tensor's name found in a table made once per trace where fx walks all of the model's
        parameters at every read."""
        if not isinstance(attr_val, torch.Tensor) or self.param_shapes_constant:
            return super().getattr(attr, attr_val, parameter_proxy_cache)
        params, buffers = self._tensor_names()
        name = params.get(id(attr_val)) if isinstance(attr_val, nn.Parameter) else None
        if name is None and self.proxy_buffer_attributes:
            name = buffers.get(id(attr_val))
        if name is None:
            return attr_val
        if name not in parameter_proxy_cache:
            parameter_proxy_cache[name] = self.create_proxy("get_attr", name, (), {})
        return parameter_proxy_cache[name]

    def _tensor_names(self) -> tuple[dict[int, str], dict[int, str]]:
        """The root's parameters and buffers by identity -> their first qualified names."""
        if self._names_of is not self.root:
            self._names_of = self.root
            self._names = ({id(p): n for n, p in self.root.named_parameters()},  # each tensor once, by its first name
                           {id(b): n for n, b in self.root.named_buffers()})
        return self._names

    def create_node(self, *args: Any, **kwargs: Any) -> torch.fx.Node:
        node = super().create_node(*args, **kwargs)
        if self.decomposing:
            self.decomposed.append(node)
        return node

    def trace(self, root: Any, concrete_args: dict[str, Any] | None = None) -> torch.fx.Graph:
        cls = type(root)
        decomposition = DECOMPOSITIONS.get(cls) if isinstance(root, nn.Module) else None
        if decomposition is not None:  # traced as an instance of a subclass whose forward is the decomposition
            root.__class__ = _decomposed_class(cls, decomposition)
            self.decomposing += 1
        try:
            graph = super().trace(root, concrete_args)
        finally:
            if decomposition is not None:
                root.__class__ = cls
                self.decomposing -= 1
        for node in reversed(self.decomposed):
            if not node.users and node.op in ("call_function", "call_method", "get_attr"):
                graph.erase_node(node)
        return graph


@functools.cache
def _decomposed_class(cls: type, forward: Callable[..., Any]) -> type:
    return type(cls.__name__, (cls,), {"forward": forward, "__module__": cls.__module__})


def bind_inputs(module: nn.Module, args: tuple, kwargs: dict) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split a call into traced tensor inputs and concrete values frozen at what the call passed
    (defaults for omitted optional arguments). Tensors inside a list or dict cannot be either: refused."""
    sig = inspect.signature(type(module).forward)
    bound = sig.bind(module, *args, **kwargs)
    bound.apply_defaults()
    traced, concrete = {}, {}
    for name, value in list(bound.arguments.items())[1:]:
        kind = sig.parameters[name].kind
        if kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            if value:
                raise TraceError(f"{type(module).__name__}.forward takes *args/**kwargs; pass them by name")
            continue
        if not torch.is_tensor(value) and any(torch.is_tensor(t) for t in tree_leaves(value)):
            raise TraceError(f"{type(module).__name__}.forward's argument {name} holds tensors in a "
                             f"{type(value).__name__}: symbolic tracing would freeze them as constants")
        (traced if torch.is_tensor(value) else concrete)[name] = value
    return traced, concrete


def trace(module: nn.Module, name: str, args: tuple, kwargs: dict, training: bool) -> tuple[torch.fx.GraphModule, list]:
    """Trace ``module`` in the given mode; returns the graph module and the values of its placeholders."""
    installed = GraphForward.of(module)
    served = installed.graph_for(args, kwargs, training) if installed is not None else None
    if served is not None:  # already operated on: its current graph for this call is the truth
        graph = _with_literal_counts(strip_tap_points(copy.deepcopy(served)), module)
        return graph_module(module, graph, type(module).__name__), _placeholder_values(graph, args, kwargs)
    traced, concrete = bind_inputs(module, args, kwargs)
    tracer = Tracer()
    try:
        with training_mode(module, training):
            graph = tracer.trace(module, concrete_args=concrete or None)
    except Exception as e:  # torch.fx raises many types; the user needs the module and the cause
        label = name or "the model"
        raise TraceError(f"cannot trace {label} ({type(module).__name__}): {type(e).__name__}: {e}") from e
    values = _name_placeholders(graph, {**traced, **concrete})
    gm = graph_module(module, graph, type(module).__name__)
    gm.meta[MODULE_CALLS] = _as_nodes(tracer.module_calls)
    return gm, values


def _as_nodes(calls: dict[str, tuple[tuple, dict]]) -> dict[str, tuple[tuple, dict]]:
    """The calls whose proxies stand for nodes (an attribute read, ``x.shape``, makes its node only when used: a
    call that passes one is left out), with their nodes in place of the proxies."""
    def node(value: Any) -> Any:
        if isinstance(value, torch.fx.proxy.Attribute):
            raise LookupError
        return value.node if isinstance(value, torch.fx.Proxy) else value

    found = {}
    for path, call in calls.items():
        try:
            found[path] = tree_map(node, call)
        except LookupError:
            continue
    return found


def _with_literal_counts(graph: torch.fx.Graph, module: nn.Module) -> torch.fx.Graph:
    """Put the current values of an operated graph's count attributes (plain ints on the host) back as
    literals, as tracing would have baked them."""
    for node in list(graph.nodes):
        if node.op == "get_attr" and type(value := getattr(module, node.target, None)) is int:
            substitute(node, value)
    return graph


def substitute(node: torch.fx.Node, value: Any) -> None:
    """Put ``value`` wherever ``node`` is used, then drop ``node``."""
    def swap(n: torch.fx.Node) -> Any:
        return value if n is node else n

    for user in list(node.users):
        user.args = torch.fx.node.map_arg(user.args, swap)
        user.kwargs = torch.fx.node.map_arg(user.kwargs, swap)
    node.graph.erase_node(node)


class FunctionKey(NamedTuple):
    """What a helper function's trace depends on: the function, its frozen (non-tensor) arguments as ``repr`` gives
    them, sorted by name, and each tensor argument's name, shape and dtype."""

    function: Any
    frozen: str
    tensors: tuple[tuple[str, tuple[int, ...], torch.dtype], ...]


FUNCTION_GRAPHS_LIMIT = 512  # helper traces kept (a model calls a few helpers, each once per block)
# the traces of plain helper functions, shared by every analysis of the process
function_graphs: LruCache[FunctionKey, torch.fx.GraphModule] = LruCache(FUNCTION_GRAPHS_LIMIT)


def trace_function(fn: Any, arguments: dict[str, Any]) -> tuple[torch.fx.GraphModule, list]:
    """Trace a plain function with its tensor arguments symbolic and the rest frozen (cached per
    function, frozen values and tensor shapes: helpers are called once per block)."""
    concrete = {k: v for k, v in arguments.items() if not torch.is_tensor(v)}
    key = FunctionKey(fn, repr(sorted(concrete.items())),
                      tuple((k, tuple(v.shape), v.dtype) for k, v in arguments.items() if torch.is_tensor(v)))
    gm = function_graphs.get_or_make(key, lambda: _traced_function(fn, arguments, concrete))
    return gm, _name_placeholders(gm.graph, arguments)


def _traced_function(fn: Any, arguments: dict[str, Any], concrete: dict[str, Any]) -> torch.fx.GraphModule:
    """``fn`` traced with the ``concrete`` arguments frozen, its placeholders named after ``arguments``."""
    tracer = Tracer()
    try:
        graph = tracer.trace(fn, concrete_args=concrete or None)
    except Exception as e:
        raise TraceError(f"cannot trace {getattr(fn, '__name__', fn)}: {type(e).__name__}: {e}") from e
    _name_placeholders(graph, arguments)
    return graph_module(tracer.root, graph)


def _name_placeholders(graph: torch.fx.Graph, arguments: dict[str, Any]) -> list:
    """Values for the placeholders. fx names a frozen argument's placeholders ``{name}_{k}``, one per
    leaf of its value; a single one is renamed back to the caller's keyword name."""
    values = []
    flattening = pytree_info(graph) is not None
    for node in graph.nodes:
        if node.op != "placeholder":
            continue
        if flattening:
            node.args = ()  # fx emits defaults inside its flattening unpack, which does not compile
        name = node.target
        if name in arguments:
            values.append(arguments[name])
            continue
        base, _, k = name.rpartition("_")
        if base not in arguments or not k.isdigit():
            values.append(node.args[0] if node.args else None)
            continue
        leaves = tree_leaves(arguments[base])
        if len(leaves) <= 1 and not flattening:
            node.target = base
        values.append(leaves[int(k) - 1] if leaves else arguments[base])
    return values


def _placeholder_values(graph: torch.fx.Graph, args: tuple, kwargs: dict) -> list:
    """Placeholder values of an installed graph for a recorded call."""
    names = [n.target for n in graph.nodes if n.op == "placeholder"]
    values = dict(zip(names, args))
    values.update(kwargs)
    return [values[n.target] if n.target in values else (n.args[0] if n.args else None)
            for n in graph.nodes if n.op == "placeholder"]
