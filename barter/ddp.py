"""BARTER under torch.distributed: the DistributedDataParallel wrapper that follows the transfers, and the
all-reduce that gives every rank the global batch's scores.

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


class EditCounter(Protocol):
    """What `DistributedModel` reads of a controller: how many surgeries it made on the model so far."""

    edits: int


class DistributedModel(nn.Module):
    """DistributedDataParallel over a model wrapped by `barter.wrap`, rebuilt after each transfer.

    A transfer resizes parameters in place and renews their gradient accumulators, so the buckets and hooks
    of a DistributedDataParallel built before it are stale. Before the first forward after the controller
    edited the model, this wrapper drops the old one and builds a new one with the same options (the
    optimizer keeps working: fxsurgery resizes the same parameter objects and their state). Every rank edits
    at the same step, so every rank rebuilds at the same forward. `module` is the bare model: evaluate, save
    and load through it. Without a controller it is plain DistributedDataParallel.
    """

    def __init__(self, model: nn.Module, controller: EditCounter | None = None, **ddp_options: Any) -> None:
        super().__init__()
        self.module = model
        self.controller = controller
        self.ddp_options = ddp_options
        self._build()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.controller is not None and self.controller.edits != self._edits_built:
            self._build()
        return self.ddp(*args, **kwargs)

    def _build(self) -> None:
        self.ddp = None  # the old wrapper's gradient hooks go with it, before the new one adds its own
        self._edits_built = 0 if self.controller is None else self.controller.edits
        self.ddp = DistributedDataParallel(self.module, **self.ddp_options)


def world_size() -> int:
    """Processes in the initialised process group; 1 outside torch.distributed."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def global_batch_scores(pending: Tensor, samples: int) -> Tensor:
    """The global batch's per-unit scores from each rank's `pending` scores of its `samples` images, in one
    all-reduce (see `barter.scores`): the sample-weighted mean over the ranks, over the world size."""
    weighted = torch.cat((pending.flatten() * samples, pending.new_tensor([samples])))
    dist.all_reduce(weighted)
    return weighted[:-1].view_as(pending) / (weighted[-1] * dist.get_world_size())
