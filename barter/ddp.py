"""BARTER under torch.distributed: DistributedDataParallel that follows the transfers (`follow_transfers` for
a wrapper a framework built, `DistributedModel` for your own loop), and the all-reduce that gives every rank
the global batch's scores.

Every rank makes every decision itself, on identical inputs: the score tables all-reduce their scores before
each EMA update (`global_batch_scores`), selection's random variants draw from `select_rng` and split noise
from `noise_rng`, both seeded with `seed` on every rank, so every rank edits the model alike at the same step.
Outside torch.distributed (or with one process) nothing here communicates.
"""
from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.hooks import RemovableHandle


class EditCounter(Protocol):
    """What `DistributedModel` reads of a controller: how many surgeries it made on the model so far."""

    edits: int


class DistributedModel(nn.Module):
    """DistributedDataParallel over a model wrapped by `barter.wrap`, that follows the transfers.

    `ddp` is the DistributedDataParallel wrapper, kept valid across transfers by `follow_transfers`. `module`
    is the bare model: evaluate, save and load through it. Without a controller it is plain
    DistributedDataParallel.
    """

    def __init__(self, model: nn.Module, controller: EditCounter | None = None, **ddp_options: Any) -> None:
        super().__init__()
        self.module = model
        self.controller = controller
        self.ddp = DistributedDataParallel(model, **ddp_options)
        if controller is not None:
            follow_transfers(self.ddp, controller)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.ddp(*args, **kwargs)


def follow_transfers(ddp: DistributedDataParallel, controller: EditCounter) -> RemovableHandle:
    """Keep `ddp`, a DistributedDataParallel over a model `controller` edits, valid across the transfers.

    A transfer resizes parameters in place and renews their gradient accumulators, so the reducer (gradient
    buckets and hooks) built before it is stale. Before the first forward after an edit, a pre-hook rebuilds
    the reducer of the same wrapper object (`rebuild_reducer`), so a training loop's references to it stay
    valid, and so does the optimizer (the same parameter objects, resized with their state). Every rank edits
    at the same step, so every rank rebuilds at the same forward. Returns the hook's handle.
    """
    if ddp.process_group is not dist.group.WORLD:
        raise ValueError("following transfers rebuilds DistributedDataParallel's reducer in place, which torch "
                         "supports on the default process group only")
    built = controller.edits

    def rebuild_after_edits(module: nn.Module, args: tuple) -> None:
        nonlocal built
        if controller.edits != built:
            built = controller.edits
            rebuild_reducer(ddp)

    return ddp.register_forward_pre_hook(rebuild_after_edits)


def rebuild_reducer(ddp: DistributedDataParallel) -> None:
    """Rebuild `ddp`'s reducer from its module's current parameters, with the wrapper's own options: torch's
    unpickling path (`__setstate__` builds the reducer afresh), on the wrapper's own state."""
    state = ddp.__getstate__()
    ddp.reducer = ddp.logger = None  # the old reducer's gradient hooks go before the new one adds its own
    ddp.__setstate__(state)


def world_size() -> int:
    """Processes in the initialised process group; 1 outside torch.distributed."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def global_batch_scores(pending: Tensor, samples: int) -> Tensor:
    """The global batch's per-unit scores from each rank's `pending` scores of its `samples` images, in one
    all-reduce (see `barter.scores`): the sample-weighted mean over the ranks, over the world size."""
    weighted = torch.cat((pending.flatten() * samples, pending.new_tensor([samples])))
    dist.all_reduce(weighted)
    return weighted[:-1].view_as(pending) / (weighted[-1] * dist.get_world_size())
