"""The private torch APIs the project relies on, each reached from here only, by a name that says what it is for.

torch may move or change a private name in any release. Keeping every one in this file, wrapped by a small function
or re-exported, puts an upgrade's breakage in one place: ``tests/test_compat.py`` exercises each entry on the
installed torch, and fails on a private torch name reached anywhere else in the project. ``PRIVATE_TORCH_NAMES`` is
the table of what is reached, spelled as that check finds it. (barter's private Lightning name lives in
``barter.integrations.lightning_compat``; this module imports torch only.)
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
           "EXPORT_SPECIALISATION_LOGGER", "module_hooks", "NormBase", "ConvNd", "self_attention_block",
           "feed_forward_block", "dynamo_config", "foreach_mul_", "device_scale", "DispatchMode",
           "returns_new_tensors", "fsdp_records", "reshard_resized", "hold_empty", "graph_module", "is_fake",
           "outside_traces"]

# each private name as the check spells it (``._name``: an attribute of a torch object, or text fx generates)
# -> the name of this module that reaches it
PRIVATE_TORCH_NAMES: dict[str, str] = {
    "torch.utils._pytree.tree_leaves": "tree_leaves",
    "torch.utils._pytree.tree_map": "tree_map",
    "torch.utils._pytree.tree_unflatten": "tree_unflatten",
    "torch.fx._pytree.tree_flatten_spec": "flatten_to_spec",
    "torch.fx._lazy_graph_module._make_graph_module": "graph_module",
    "torch.fx._lazy_graph_module._use_lazy_graph_module": "graph_module",
    "._codegen": "pytree_info",
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
    "torch.nn.modules.batchnorm._NormBase": "NormBase",
    "torch.nn.modules.conv._ConvNd": "ConvNd",
    "._sa_block": "self_attention_block",
    "._ff_block": "feed_forward_block",
    "torch._dynamo.config": "dynamo_config",
    "torch._foreach_mul_": "foreach_mul_",
    "._get_scale_async": "device_scale",
    "._get_fsdp_state": "fsdp_records",
    "._fsdp_param_group": "fsdp_records",
    "._orig_param_uid": "reshard_resized",
    "._init_sharded_param": "reshard_resized",
    "._init_sharded_post_forward_param_metadata": "reshard_resized",
    "._setattr_on_modules": "reshard_resized",
    "._unsharded_param": "reshard_resized",
    "._unsharded_inner_tensors": "reshard_resized",
    "._local_tensor": "hold_empty",
    "torch._subclasses.fake_tensor.is_fake": "is_fake",
    "torch._C._len_torch_function_stack": "outside_traces",
    "torch.overrides._pop_mode_temporarily": "outside_traces",
    "torch.utils._python_dispatch._disable_current_modes": "outside_traces",
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
    ``torch.utils._python_dispatch._disable_current_modes``, torch >= 2.1)."""
    with contextlib.ExitStack() as stack:
        for _ in range(torch._C._len_torch_function_stack()):
            stack.enter_context(torch.overrides._pop_mode_temporarily())
        stack.enter_context(torch.utils._python_dispatch._disable_current_modes())
        yield


#: The logger by which non-strict ``torch.export`` reports each dim it specialises (torch >= 2.3).
EXPORT_SPECIALISATION_LOGGER = "torch._export.non_strict_utils"


def module_hooks(module: nn.Module) -> list[Callable[..., Any]]:
    """The forward, forward-pre, backward and backward-pre hooks registered on ``module`` itself (``Module``'s hook
    dicts; ``_backward_pre_hooks`` since torch 2.0)."""
    hook_dicts = (module._forward_pre_hooks, module._forward_hooks, module._backward_pre_hooks, module._backward_hooks)
    return [hook for hooks in hook_dicts for hook in hooks.values()]


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


def dynamo_config() -> Any:
    """dynamo's settings module, whose recompile limits ``barter.compiling`` raises (``torch._dynamo.config``; the
    limits are ``recompile_limit`` and ``accumulated_recompile_limit`` since torch 2.6)."""
    return torch._dynamo.config


#: ``tensors[i] *= scalars[i]`` (or ``*= scalar``) over lists of tensors in one fused kernel per device and dtype,
#: as torch's optimizers step (``torch._foreach_mul_``, torch >= 1.7).
foreach_mul_ = torch._foreach_mul_


def device_scale(scaler: Any) -> torch.Tensor | None:
    """A GradScaler's scale as its device tensor, read without a host sync (``GradScaler._get_scale_async``,
    torch >= 1.6); None for a scaler without that reader, or one that has not scaled yet."""
    read = getattr(scaler, "_get_scale_async", None)
    return read() if read is not None else None


def fsdp_records(module: nn.Module) -> list[Any]:
    """The records (``FSDPParam``) of the parameters that ``fully_shard(module)`` shards as ``module``'s own group,
    each with its ``sharded_param`` (the DTensor Parameter the module holds and an optimizer steps); [] for a
    module without parameters of its own (``FSDPModule._get_fsdp_state()._fsdp_param_group``, torch >= 2.6)."""
    group = module._get_fsdp_state()._fsdp_param_group
    return [] if group is None else list(group.fsdp_params)


def reshard_resized(record: Any, values: torch.Tensor) -> None:
    """Make the parameter FSDP2's ``record`` (an ``FSDPParam``) shards hold ``values``: the whole tensor at a new
    size, equal on every rank, sharded on dim 0 as ``fully_shard`` shards it, in the same Parameter object (an
    optimizer's, with its attributes). The unsharded parameter and the all-gather buffers, sized for the old shape,
    are made afresh at the next all-gather. The record must be sharded (``FSDPModule.reshard()``).

    ``FSDPParam._init_sharded_param`` shards a new Parameter and sets the sizes the collectives read; its content
    is swapped into the old Parameter object (torch >= 2.6)."""
    param = record.sharded_param
    attributes, uid = dict(param.__dict__), record._orig_param_uid
    whole = nn.Parameter(values.to(record.device), requires_grad=param.requires_grad)
    record._init_sharded_param(whole, record.device, None, record.mesh_info)
    if record.post_forward_mesh_info is not None:
        record._init_sharded_post_forward_param_metadata(whole)
    torch.utils.swap_tensors(param, record.sharded_param)
    param.__dict__.update(attributes)
    record.sharded_param = param
    record._setattr_on_modules(param)
    record._orig_param_uid = uid
    record.all_gather_outputs = []
    if hasattr(record, "_unsharded_param"):
        del record._unsharded_param
    record._unsharded_inner_tensors = []
    record.unsharded_accumulated_grad = None
    hold_empty(record)


def hold_empty(record: Any) -> None:
    """Make FSDP2's ``record`` of a parameter with no elements (a layer emptied of its heads) one FSDP2 can gather
    and step: its shard shaped as its DTensor says (torch gives the shard of a tensor with no elements the shape
    (0, ...) whatever its dim 0, which ``full_tensor``, state dicts and checkpoints refuse) and no gradient (FSDP2's
    reduce-scatter refuses an empty one: ``_chunk_cat expects non-empty tensor``; nothing in it can learn). A
    parameter with elements is left as it is. The record must be sharded. After a ``load_state_dict`` or
    ``module.to``, torch pads a shard again (``FSDPParam.reset_sharded_param``), which fails on a shard shaped as
    its DTensor says with fewer rows than the padded one: an empty one, with nothing to pad, is held instead."""
    param = record.sharded_param
    if param.numel():
        return
    from torch.distributed.tensor import distribute_tensor

    if "reset_sharded_param" not in vars(record):
        reset = record.reset_sharded_param

        def reset_and_hold() -> None:
            if record.sharded_param.numel():
                reset()
            else:
                hold_empty(record)

        record.reset_sharded_param = reset_and_hold

    whole = torch.empty(param.shape, dtype=param.dtype, device=record.device)
    local = distribute_tensor(whole, param.device_mesh, param.placements, src_data_rank=None).to_local()
    param._local_tensor = local
    record.sharded_size = local.shape
    record.contiguous_sharded_stride = local.stride()
    param.requires_grad_(False)
