"""The private torch APIs fxsurgery relies on, each reached from here only, by a name that says what it is for.

torch may move or change a private name in any release. Keeping every one in this file, wrapped by a small function
or re-exported, puts an upgrade's breakage in one place: ``tests/test_compat.py`` exercises each entry on the
installed torch, and fails on a private torch name reached anywhere else in the project. ``PRIVATE_TORCH_NAMES`` is
the table of what is reached, spelled as that check finds it. These are fxsurgery's own: barter keeps the private
torch names it relies on in ``barter.compat`` and its private Lightning name in
``barter.integrations.lightning_compat``. This module imports torch only.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
import torch.fx
import torch.nn as nn
from torch.fx._lazy_graph_module import _make_graph_module, _use_lazy_graph_module  # code made at first run (2.2)
from torch.fx._pytree import tree_flatten_spec as flatten_to_spec  # arguments flattened by a graph's input spec
from torch.utils._python_dispatch import TorchDispatchMode as DispatchMode  # intercepts ATen ops (torch >= 1.13)
from torch.utils._pytree import (  # nested lists, tuples and dicts (tree_map since torch 1.10, tree_leaves 2.1)
    tree_leaves,  # the leaves of a nested structure
    tree_map,  # the structure with a function applied to every leaf
    tree_unflatten,  # leaves put back into the structure a TreeSpec describes
)

__all__ = ["PRIVATE_TORCH_NAMES", "tree_leaves", "tree_map", "tree_unflatten", "flatten_to_spec", "pytree_info",
           "GENERATED_SPEC_READS", "running_node", "rename_node", "OpOverload", "overload_name", "switch_grad_mode",
           "EXPORT_SPECIALISATION_LOGGER", "module_hooks", "own_tensor_tables", "own_module_table",
           "version_counter", "NormBase", "ConvNd",
           "self_attention_block", "feed_forward_block", "DispatchMode", "returns_new_tensors", "graph_module",
           "is_fake", "outside_traces", "is_pytree_node", "register_pytree_node", "pytree_node_registered",
           "spec_with_types", "set_out_spec"]

# each private name as the check spells it (``._name``: an attribute of a torch object, or text fx generates)
# -> the name of this module that reaches it
PRIVATE_TORCH_NAMES: dict[str, str] = {
    "torch.utils._pytree.tree_leaves": "tree_leaves",
    "torch.utils._pytree.tree_map": "tree_map",
    "torch.utils._pytree.tree_unflatten": "tree_unflatten",
    "torch.fx._pytree.tree_flatten_spec": "flatten_to_spec",
    "torch.fx._lazy_graph_module._make_graph_module": "graph_module",
    "torch.fx._lazy_graph_module._use_lazy_graph_module": "graph_module",
    "self._in_spec": "GENERATED_SPEC_READS",
    "self._out_spec": "GENERATED_SPEC_READS",
    "._set_current_node": "running_node",
    "._rename": "rename_node",
    "torch._ops.OpOverload": "OpOverload",
    "torch.utils._python_dispatch.TorchDispatchMode": "DispatchMode",
    "._schema": "returns_new_tensors",
    "._overloadname": "overload_name",
    "torch._C._set_grad_enabled": "switch_grad_mode",
    "torch._export.non_strict_utils": "EXPORT_SPECIALISATION_LOGGER",
    "._forward_pre_hooks": "module_hooks",
    "._forward_hooks": "module_hooks",
    "._backward_pre_hooks": "module_hooks",
    "._backward_hooks": "module_hooks",
    "._parameters": "own_tensor_tables",
    "._buffers": "own_tensor_tables",
    "._modules": "own_module_table",
    "._version": "version_counter",
    "torch.nn.modules.batchnorm._NormBase": "NormBase",
    "torch.nn.modules.conv._ConvNd": "ConvNd",
    "._sa_block": "self_attention_block",
    "._ff_block": "feed_forward_block",
    "torch._subclasses.fake_tensor.is_fake": "is_fake",
    "torch._C._len_torch_function_stack": "outside_traces",
    "torch.overrides._pop_mode_temporarily": "outside_traces",
    "torch.utils._python_dispatch._disable_current_modes": "outside_traces",
    "torch.export._trace": "outside_traces",
    "torch.utils._pytree.SUPPORTED_NODES": "is_pytree_node",
    "torch.utils._pytree.register_pytree_node": "register_pytree_node",
    "torch.utils._pytree.GetAttrKey": "register_pytree_node",
    "torch.utils._pytree._deregister_pytree_node": "pytree_node_registered",
    "torch.utils._pytree.TreeSpec": "spec_with_types",
    "._codegen": "pytree_info",
}

def graph_module(root: nn.Module, graph: torch.fx.Graph, class_name: str = "GraphModule") -> torch.fx.GraphModule:
    """A ``GraphModule`` whose Python code is generated when it first runs, not when it is built: the analysis reads
    most graphs it traces without running them (fx's lazy graph module, torch >= 2.2)."""
    with _use_lazy_graph_module(True):
        return _make_graph_module(root, graph, class_name)


def pytree_info(graph: torch.fx.Graph) -> Any:
    """The input/output specs of a graph that flattens structured arguments (``in_spec``, ``out_spec``), else None:
    fx keeps them on the graph's code generator (``Graph._codegen``, torch >= 1.12)."""
    return getattr(graph._codegen, "pytree_info", None)


def set_out_spec(graph: torch.fx.Graph, out_spec: Any) -> None:
    """Make ``graph`` (one that flattens structured arguments) build its outputs by ``out_spec`` (the spec on its
    code generator, ``Graph._codegen.pytree_info``, torch >= 1.12)."""
    graph._codegen.pytree_info = graph._codegen.pytree_info._replace(out_spec=out_spec)


def is_pytree_node(cls: type) -> bool:
    """Whether pytree (and so ``torch.export``) flattens objects of type ``cls`` as a container
    (``torch.utils._pytree.SUPPORTED_NODES``, torch >= 2.0)."""
    return cls in torch.utils._pytree.SUPPORTED_NODES


def register_pytree_node(cls: type, flatten: Callable[[Any], tuple[dict[str, Any], Any]],
                         unflatten: Callable[[list, Any], Any]) -> None:
    """Have pytree flatten objects of type ``cls`` into children: ``flatten(obj)`` gives them by attribute name (the
    keys ``torch.export`` names them by) with a context, ``unflatten(children, context)`` rebuilds the object
    (``torch.utils._pytree.register_pytree_node`` and ``GetAttrKey``, torch >= 2.2)."""
    def children(obj: Any) -> tuple[list, Any]:
        named, context = flatten(obj)
        return list(named.values()), context

    def keyed(obj: Any) -> tuple[list, Any]:
        named, context = flatten(obj)
        return [(torch.utils._pytree.GetAttrKey(name), child) for name, child in named.items()], context

    torch.utils._pytree.register_pytree_node(cls, children, unflatten, flatten_with_keys_fn=keyed,
                                             serialized_type_name=f"{cls.__module__}.{cls.__qualname__}")


@contextlib.contextmanager
def pytree_node_registered(cls: type, flatten: Callable[[Any], tuple[dict[str, Any], Any]],
                           unflatten: Callable[[list, Any], Any]) -> Iterator[None]:
    """``cls`` registered as ``register_pytree_node`` does while the block runs, then taken out of the registry
    (``torch.utils._pytree._deregister_pytree_node``, torch >= 2.2)."""
    register_pytree_node(cls, flatten, unflatten)
    try:
        yield
    finally:
        torch.utils._pytree._deregister_pytree_node(cls)


def spec_with_types(spec: Any, replace: Callable[[Any], Any]) -> Any:
    """The tree spec ``spec`` with the type of each of its nodes replaced by ``replace(type)``; contexts and
    leaves as they are (``torch.utils._pytree.TreeSpec``, torch >= 2.0)."""
    if spec.is_leaf():
        return spec
    return torch.utils._pytree.TreeSpec(replace(spec.type), spec.context,
                                        [spec_with_types(child, replace) for child in spec.children()])


#: How the Python code fx generates for such a graph reads its specs (from ``self``, the graph module; torch >= 1.12):
#: a forward compiled for a module other than the graph module reads them from its globals instead.
GENERATED_SPEC_READS = ("self._in_spec", "self._out_spec")


@contextlib.contextmanager
def running_node(interpreter: torch.fx.Interpreter, node: torch.fx.Node) -> Iterator[None]:
    """Run what follows as ``interpreter``'s own ``run_node`` runs ``node``: with the node's meta as fx's current meta
    where node meta is preserved (``Interpreter._set_current_node``, torch >= 2.1)."""
    with interpreter._set_current_node(node):
        yield


def rename_node(node: torch.fx.Node, name: str) -> None:
    """Rename ``node`` to ``name`` in its graph's namespace, with a numeric suffix where the namespace has used it
    (an erased node's name stays used; ``Node._rename``, torch >= 1.8)."""
    node._rename(name)


#: The class of an ATen op overload as export's graphs call it (``aten.add.Tensor``; torch >= 1.12).
OpOverload = torch._ops.OpOverload


def overload_name(op: OpOverload) -> str:
    """The overload part of an op's name (``"Tensor"`` of ``aten.add.Tensor``; ``OpOverload._overloadname``,
    torch >= 1.12)."""
    return op._overloadname


def returns_new_tensors(op: Any) -> bool:
    """Whether an ATen op writes none of its arguments and returns no view of one (its schema has no mutable
    argument and no aliased return; ``OpOverload._schema``, torch >= 1.12); False for anything without a schema."""
    schema = getattr(op, "_schema", None)
    return schema is not None and not schema.is_mutable and all(r.alias_info is None for r in schema.returns)


#: The function that switches grad mode as a graph's call (what export's grad regions do; the public
#: ``torch.set_grad_enabled`` is a context manager class). ``torch._C._set_grad_enabled``, torch >= 0.4.
switch_grad_mode = torch._C._set_grad_enabled


def is_fake(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a fake one (shapes and dtypes, no values), as ``torch.export`` and ``make_fx`` trace
    with, itself or inside a functional wrapper (``torch._subclasses.fake_tensor.is_fake``, torch >= 2.0)."""
    return torch._subclasses.fake_tensor.is_fake(tensor)


@contextlib.contextmanager
def outside_traces() -> Iterator[None]:
    """Run what follows as plain eager code, neither recorded nor faked by a trace that is running (the
    torch-function and dispatch modes of ``torch.export``, ``make_fx`` or a fake tensor mode are set aside, then
    put back in order; ``torch.overrides._pop_mode_temporarily`` and
    ``torch.utils._python_dispatch._disable_current_modes``, torch >= 2.1). A capture run inside (a call of a new
    signature met while ``torch.export`` runs) sets and clears the running export's module globals
    (``torch.export._trace``'s ``_EXPORT_FLAGS`` and ``_EXPORT_MODULE_HIERARCHY``, torch >= 2.3): they are put back."""
    import torch.export._trace as export_trace

    running_export = {name: getattr(export_trace, name) for name in _EXPORT_GLOBALS if hasattr(export_trace, name)}
    with contextlib.ExitStack() as stack:
        for _ in range(torch._C._len_torch_function_stack()):
            stack.enter_context(torch.overrides._pop_mode_temporarily())
        stack.enter_context(torch.utils._python_dispatch._disable_current_modes())
        try:
            yield
        finally:
            for name, value in running_export.items():
                setattr(export_trace, name, value)


#: The module globals of ``torch.export._trace`` that hold the state of the export running.
_EXPORT_GLOBALS = ("_EXPORT_FLAGS", "_EXPORT_MODULE_HIERARCHY")


#: The logger by which non-strict ``torch.export`` reports each dim it specialises (torch >= 2.3).
EXPORT_SPECIALISATION_LOGGER = "torch._export.non_strict_utils"


def module_hooks(module: nn.Module) -> list[Callable[..., Any]]:
    """The forward, forward-pre, backward and backward-pre hooks registered on ``module`` itself (``Module``'s hook
    dicts; ``_backward_pre_hooks`` since torch 2.0)."""
    hook_dicts = (module._forward_pre_hooks, module._forward_hooks, module._backward_pre_hooks, module._backward_hooks)
    return [hook for hooks in hook_dicts for hook in hooks.values()]


def own_tensor_tables(module: nn.Module) -> tuple[dict[str, Any], dict[str, Any]]:
    """The dicts that hold ``module``'s own parameters and buffers by name (``Module._parameters`` and
    ``_buffers``): writing an entry replaces the tensor without the checks of ``setattr``, as a meta one must be."""
    return module._parameters, module._buffers


def own_module_table(module: nn.Module) -> dict[str, Any]:
    """The dict that holds ``module``'s own submodules by name (``Module._modules``)."""
    return module._modules


def version_counter(tensor: torch.Tensor) -> int:
    """How many times ``tensor`` was written in place (``Tensor._version``, bumped by every in-place op)."""
    return tensor._version


#: The base class of the batch and instance norms, whose feature count is ``num_features`` (torch >= 1.5).
NormBase = nn.modules.batchnorm._NormBase
#: The base class of the convolutions and transposed convolutions (torch >= 1.0).
ConvNd = nn.modules.conv._ConvNd


def self_attention_block(layer: nn.TransformerEncoderLayer, x: torch.Tensor, attn_mask: torch.Tensor | None,
                         key_padding_mask: torch.Tensor | None, is_causal: bool) -> torch.Tensor:
    """The self-attention branch of an encoder layer's training path, dropout included
    (``TransformerEncoderLayer._sa_block``, torch >= 1.10; ``is_causal`` since 2.0)."""
    return layer._sa_block(x, attn_mask, key_padding_mask, is_causal=is_causal)


def feed_forward_block(layer: nn.TransformerEncoderLayer, x: torch.Tensor) -> torch.Tensor:
    """The feed-forward branch of an encoder layer's training path (``TransformerEncoderLayer._ff_block``,
    torch >= 1.10)."""
    return layer._ff_block(x)
