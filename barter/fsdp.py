"""BARTER under FSDP2 (`torch.distributed.fsdp.fully_shard`): transfers on a model whose parameters are sharded
over the processes, with FSDP2's own state and the optimizer kept valid.

Order. `barter.wrap` analyses and compacts the whole, unsharded model, so it comes first; `fully_shard` comes
after, per block and at the root (as torch's docs and torchtitan shard), then the optimizer is built on the
sharded parameters and attached:

    ctl = barter.wrap(model, total_steps=T, density=0.5)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters())
    ctl.attach_optimizer(optimizer)

A model sharded already is refused by `barter.wrap` (`refuse_sharded`), and so are FSDP1
(`FullyShardedDataParallel`), DeepSpeed ZeRO and a mesh of more than one dim (HSDP, tensor parallel)
(`check_supported`).

Transfers. Every rank makes the same decision at the same step from all-reduced scores (as under DDP,
`barter.ddp`). An edit reads only the group's own tensors and their optimizer state, each gathered whole
(`ShardedAccess.values`), edits them with fxsurgery's engine, and shards them again on the same mesh: a parameter
through its FSDP2 record (`barter.compat.reshard_resized`, the same Parameter object), an optimizer state
tensor as a DTensor laid out like the parameter. No rank holds more than the edited group's tensors whole.

Empty layers. A layer may lose every head: its parameters then have no elements. FSDP2 keeps them sharded (and
all-gathers them, empty) but stops their gradients, which its reduce-scatter refuses (`hold_empty_parameters`):
after each edit, in `shard`, and when an optimizer is attached (a model loaded with an empty layer, then sharded).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel, fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from fxsurgery import Surgeon, TensorAccess, replace_data

from .analysis import keep_base, model_base
from .compat import fsdp_records, hold_empty, reshard_resized
from .pretrained import record_call, recorded_call

SUPPORTED = ("one process (no sharding), DistributedDataParallel (barter.DistributedModel) and FSDP2 "
             "(torch.distributed.fsdp.fully_shard on a 1-D mesh, applied after barter.wrap)")


class UnsupportedSharding(ValueError):
    """A way of spreading a model over processes whose tensors BARTER cannot resize."""


def refuse_sharded(model: nn.Module) -> None:
    """`barter.wrap` analyses the whole model: refuse one that FSDP (either version) or DeepSpeed holds already."""
    check_supported(model)
    if is_sharded(model):
        raise UnsupportedSharding(
            "barter.wrap analyses and compacts the whole model, which fully_shard has sharded already: call "
            "barter.wrap(model, ...) first, then fully_shard each block and the root, then build the optimizer "
            "and ctl.attach_optimizer(optimizer)")


def check_supported(model: nn.Module) -> None:
    """Refuse FSDP1, DeepSpeed ZeRO and parameters sharded over a mesh of more than one dim, naming what works."""
    if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        raise UnsupportedSharding(f"FSDP1 (FullyShardedDataParallel) flattens the parameters BARTER resizes; "
                                  f"supported: {SUPPORTED}")
    for name, p in model.named_parameters():
        if hasattr(p, "ds_id"):
            raise UnsupportedSharding(f"DeepSpeed partitions the parameter {name}, which BARTER cannot resize; "
                                      f"supported: {SUPPORTED}")
        if isinstance(p, DTensor) and (p.device_mesh.ndim != 1 or tuple(p.placements) != (Shard(0),)):
            raise UnsupportedSharding(
                f"{name} is laid out as {tuple(p.placements)} over a {p.device_mesh.ndim}-D mesh (HSDP or tensor "
                f"parallel); BARTER resizes parameters sharded on dim 0 over a 1-D mesh. Supported: {SUPPORTED}")


class ShardedAccess(TensorAccess):
    """fxsurgery's access to the tensors of a model FSDP2 shards: gathered whole for an edit, sharded again after.

    Made before each edit (`tensor_access`): it puts every FSDP2 module in its sharded state and maps each sharded
    Parameter to its FSDP2 record.
    """

    def __init__(self, model: nn.Module) -> None:
        self.records: dict[int, Any] = {}
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
                self.records.update((id(r.sharded_param), r) for r in fsdp_records(module))

    def values(self, t: Tensor) -> Tensor:
        return t.detach().full_tensor() if isinstance(t, DTensor) else t.data

    def write(self, t: Tensor, values: Tensor) -> None:
        record = self.records.get(id(t))
        if record is not None:
            reshard_resized(record, values)
        elif isinstance(t, DTensor):
            raise UnsupportedSharding(f"a DTensor parameter of shape {tuple(t.shape)} that no fully_shard of this "
                                      f"model holds cannot be resized; supported: {SUPPORTED}")
        else:
            replace_data(t, values)

    def state(self, old: Tensor, values: Tensor) -> Tensor:
        if not isinstance(old, DTensor):
            return values
        # every rank holds the same whole values: each keeps its own shard, nothing is sent
        return distribute_tensor(values, old.device_mesh, old.placements, src_data_rank=None)


def is_sharded(model: nn.Module) -> bool:
    """Whether `fully_shard` holds some module of `model`."""
    return any(isinstance(m, FSDPModule) for m in model.modules())


def sharded_access(model: nn.Module) -> ShardedAccess | None:
    """The access fxsurgery's edits of `model` must go through now: sharded under FSDP2, None for plain tensors
    (after refusing the ways of sharding BARTER does not support)."""
    check_supported(model)
    return ShardedAccess(model) if is_sharded(model) else None


def hold_empty_parameters(model: nn.Module) -> None:
    """Make every parameter with no elements that fully_shard holds in `model` one FSDP2 can gather and step
    (`barter.compat.hold_empty`): sharded as its DTensor says, without a gradient."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            for record in fsdp_records(module):
                hold_empty(record)


def gathered_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """`model.state_dict()` with every sharded tensor gathered whole (collective under FSDP2: every rank calls)."""
    return {name: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for name, v in model.state_dict().items()}


def check_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Refuse what BARTER cannot resize (`check_supported`), an optimizer that does not step all the model's
    trainable parameters (the transfers would train nothing) and, under FSDP2, one that steps stale parameters
    (one built before `fully_shard`)."""
    check_supported(model)
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    if is_sharded(model):
        stale = len(stepped - {id(p) for p in model.parameters()})
        if stale:
            raise UnsupportedSharding(f"the optimizer steps {stale} parameter(s) that are not the model's: under "
                                      "FSDP2 build it after fully_shard, on model.parameters(), then "
                                      "ctl.attach_optimizer")
        return
    lacking = [name for name, p in model.named_parameters() if p.requires_grad and id(p) not in stepped]
    if lacking:
        shown = ", ".join(lacking[:8]) + (f" and {len(lacking) - 8} more" if len(lacking) > 8 else "")
        raise ValueError(f"the optimizer does not step {len(lacking)} of the wrapped model's trainable parameters "
                         f"({shown}): build it on this model's parameters, e.g. optimizer(model.parameters())")


def shard(model: nn.Module, **fully_shard_options: Any) -> nn.Module:
    """`fully_shard` each transformer block of a model `barter.wrap` made compact (the item of a ModuleList or
    Sequential that holds a unit group's host), then the root, as torchtitan shards; returns `model`."""
    base = model_base(model)
    blocks: list[nn.Module] = []
    for group in base.analysis.groups if base is not None and base.analysis is not None else []:
        block = enclosing_block(model, group.module)
        if block is not None and all(block is not b for b in blocks):
            blocks.append(block)
    for block in blocks:
        fully_shard(block, **fully_shard_options)
    fully_shard(model, **fully_shard_options)
    hold_empty_parameters(model)
    return model


def enclosing_block(model: nn.Module, host: str) -> nn.Module | None:
    """The innermost module on the path to `host` that is an item of a ModuleList or Sequential; None if none is."""
    parts = host.split(".") if host else []
    block = None
    for i in range(1, len(parts) + 1):
        if isinstance(model.get_submodule(".".join(parts[:i - 1])), (nn.ModuleList, nn.Sequential)):
            block = model.get_submodule(".".join(parts[:i]))
    return block


def whole_copy(model: nn.Module, fresh: nn.Module, counts: dict[str, int], state: dict[str, Tensor]) -> nn.Module:
    """`fresh`, a newly built base model, brought to the widths `counts` ({group name: units}) of the sharded
    `model` and loaded with `state`, `model`'s whole state dict: the unsharded model rank 0 exports (a
    transformers model's config keeps the call barter analysed, so that its `save_pretrained` folder loads)."""
    base = model_base(model)
    if base is not None and base.analysis is not None:
        surgeon = Surgeon(fresh, base.analysis)
        for group in surgeon.groups:
            if counts[group.name] < group.count:
                surgeon.keep(group, range(counts[group.name]))
        keep_base(fresh, base)
    fresh.load_state_dict(state)
    record_call(fresh, recorded_call(model))
    return fresh
