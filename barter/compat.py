"""The private torch APIs barter relies on, each reached from here only, by a name that says what it is for (as
``fxsurgery.compat`` does for fxsurgery's): ``tests/test_compat_barter.py`` exercises each entry on the installed
torch, and ``tests/test_compat.py`` fails on a private torch name reached anywhere else. ``PRIVATE_TORCH_NAMES`` is
the table of what is reached, spelled as that check finds it.

Also here, though no underscore marks them: the hook dicts a hook's handle points into
(``RemovableHandle.hooks_dict_ref``) and a module's instance ``__deepcopy__``, which ``Controller`` uses to copy a
model without its score taps (``tests/test_structure.py`` fails on either reached anywhere else).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.nn as nn
from torch.utils._device import _device_constructors as device_constructors  # the factories a device context sets
from torch.utils._python_dispatch import TorchDispatchMode as DispatchRecorder  # sees every ATen op (torch >= 1.13)
from torch.utils._pytree import (  # nested lists, tuples and dicts (tree_map since torch 1.10, tree_leaves 2.1)
    tree_leaves,  # the leaves of a nested structure
    tree_map,  # the structure with a function applied to every leaf
)
from torch.utils.hooks import RemovableHandle

__all__ = ["PRIVATE_TORCH_NAMES", "dynamo_config", "foreach_mul_", "device_scale", "fsdp_records", "reshard_resized",
           "hold_empty", "copy_with", "copy_plainly", "hooks_set_aside", "DispatchRecorder", "tree_leaves", "tree_map",
           "written_arguments", "device_constructors"]

# each private name as the check spells it (``._name``: an attribute of a torch object) -> the name of this module
# that reaches it
PRIVATE_TORCH_NAMES: dict[str, str] = {
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
    "torch.utils._python_dispatch.TorchDispatchMode": "DispatchRecorder",
    "torch.utils._pytree.tree_leaves": "tree_leaves",
    "torch.utils._pytree.tree_map": "tree_map",
    "._schema": "written_arguments",
    "torch.utils._device._device_constructors": "device_constructors",
}


def copy_with(module: nn.Module, copier: Callable[[dict], nn.Module]) -> None:
    """Make ``copy.deepcopy(module)`` return ``copier(memo)``: an instance ``__deepcopy__``, which ``copy`` finds by
    ``getattr`` on the instance (``nn.Module.__getattr__`` is not reached: the name is in the instance's dict)."""
    module.__dict__["__deepcopy__"] = copier


def copy_plainly(module: nn.Module) -> None:
    """Undo ``copy_with``: ``copy.deepcopy(module)`` copies it as any module again."""
    module.__dict__.pop("__deepcopy__", None)


@contextlib.contextmanager
def hooks_set_aside(handles: Iterable[RemovableHandle]) -> Iterator[None]:
    """Run what follows without the hooks of ``handles``, then put them back where they were, in their order among
    the other hooks of their dicts (``RemovableHandle.hooks_dict_ref``, the weak references to the dicts a handle
    removes its hook from, torch >= 1.0; a dict that is gone holds nothing to set aside)."""
    handles = list(handles)
    hook_dicts = {id(d): d for d in (h.hooks_dict_ref() for h in handles) if d is not None}
    saved = {key: list(d.items()) for key, d in hook_dicts.items()}
    hook_ids = {h.id for h in handles}
    try:
        for d in hook_dicts.values():
            for hook_id in hook_ids & d.keys():
                del d[hook_id]
        yield
    finally:
        for key, d in hook_dicts.items():
            d.clear()
            d.update(saved[key])


def written_arguments(op: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensor arguments an ATen op writes in place (``x.mul_(2)``'s ``x``, an ``out=``), as its schema marks them
    (``OpOverload._schema``, ``Argument.alias_info.is_write``, torch >= 1.12)."""
    written = []
    for position, argument in enumerate(op._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[position] if position < len(args) else kwargs.get(argument.name)
        written.extend(t for t in tree_leaves(value) if isinstance(t, torch.Tensor))
    return written


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
