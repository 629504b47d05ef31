"""The index batches of an epoch and how they split over the processes of a run."""
from __future__ import annotations

import torch

from . import processes
from .config import TrainConfig


def steps_per_epoch(n: int, config: TrainConfig, mixed: bool) -> int:
    """Optimizer steps in one epoch of `config.passes` passes over `n` images."""
    images = n * config.passes
    full, rest = divmod(images, config.batch_size)
    return full + (rest > 0 and not _drops_last(rest, config, mixed))


def epoch_batches(n: int, config: TrainConfig, mixed: bool, generator: torch.Generator) -> list[list[int]]:
    """Index batches of one epoch: `passes` independent permutations, concatenated, cut into batches."""
    order = torch.cat([torch.randperm(n, generator=generator) for _ in range(config.passes)])
    batches = list(order.split(config.batch_size))
    if len(batches[-1]) < config.batch_size and _drops_last(len(batches[-1]), config, mixed):
        batches.pop()
    return [b.tolist() for b in batches]


def _drops_last(rest: int, config: TrainConfig, mixed: bool) -> bool:
    # timm's Mixup needs an even batch; every process needs a share of the batch
    return config.drop_last or (mixed and rest % 2 == 1) or rest < processes.world_size() * granule(mixed)


def granule(mixed: bool) -> int:
    """Images of a batch that go to one process together: pairs when batch mixing pairs them up."""
    return 2 if mixed else 1
