"""The trainer's process helpers under torchrun: launcher, rank, device, process group, and the small
collectives training needs (barrier, broadcast, sums, batch shares, per-rank random streams).

Outside torch.distributed (or with one process) every helper here is the identity or a no-op.
"""
from __future__ import annotations

import os
import random
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..ddp import world_size  # the method's own notion of the world, so trainer and scores agree


def launched() -> bool:
    """Whether this process was started by torchrun (or another launcher setting RANK and WORLD_SIZE)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def rank() -> int:
    """This process's rank: the group's, else the launcher's, else 0."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def is_main() -> bool:
    """Rank 0: the process that writes files and prints."""
    return rank() == 0


def local_device(device: torch.device) -> torch.device:
    """Under a launcher, a CUDA device without an index becomes this process's own (LOCAL_RANK)."""
    if launched() and device.type == "cuda" and device.index is None:
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return device


@contextmanager
def process_group(device: torch.device) -> Iterator[None]:
    """Under a launcher, join its process group (nccl for CUDA, gloo for CPU) for the duration and leave it
    afterwards; with a group already initialised, or without a launcher, do nothing."""
    if not launched() or dist.is_initialized():
        yield
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        yield
    finally:
        dist.destroy_process_group()


def barrier() -> None:
    if world_size() > 1:
        dist.barrier()


def broadcast_from_main(obj: Any) -> Any:
    """Rank 0's `obj` on every rank (any picklable object)."""
    if world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def sum_over_ranks(values: Sequence[float]) -> list[float]:
    """Element-wise sums of `values` over the ranks, in one all-reduce (float64)."""
    if world_size() == 1:
        return [float(v) for v in values]
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    total = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
    dist.all_reduce(total)
    return total.tolist()


def shard(batch: Sequence[int], granule: int = 1) -> list[int]:
    """This rank's contiguous share of a global batch, in whole granules (pairs when batches are mixed, since
    mixing pairs the images of a batch); the shares differ by at most one granule, earlier ranks smaller."""
    units, world, r = len(batch) // granule, world_size(), rank()
    lo, hi = units * r // world, units * (r + 1) // world
    return list(batch[lo * granule:hi * granule])


def seed_rank_streams(seed: int, epoch: int) -> torch.Generator:
    """Seed this rank's torch, NumPy and Python random streams from (seed, epoch, rank), and return a
    generator seeded alike for the data loader's workers.

    Each rank then draws its own augmentations, batch mixing and dropout for its share of the global batch
    (identical streams would repeat one rank's draws on every rank), and, seeded afresh at every epoch, a run
    resumed from an epoch checkpoint repeats the uninterrupted one without storing every rank's streams.
    """
    value = int(np.random.SeedSequence([seed, epoch, rank()]).generate_state(1)[0])
    torch.manual_seed(value)
    np.random.seed(value)
    random.seed(value)
    return torch.Generator().manual_seed(value)
