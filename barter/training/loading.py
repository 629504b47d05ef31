"""Batches of a data set on the device: an in-memory tensor set gathers and augments whole batches in the
main process; any other set goes through a DataLoader, with as many worker processes as the machine suits."""
from __future__ import annotations

import os
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, Subset

from .tensorsets import TensorImages

MAX_WORKERS = 8


def default_workers() -> int:
    """Data loader processes when the config leaves them open: the CPU cores this process may use, shared
    with the other processes of the run on this machine, minus the one that trains; at most `MAX_WORKERS`."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(0, min(MAX_WORKERS, cores // local - 1))


def resolve_workers(workers: int | None) -> int:
    """`workers`, or `default_workers()` for None."""
    return default_workers() if workers is None else workers


def batches_of(dataset: Dataset, index_batches: Sequence[Sequence[int]], device: torch.device, *,
               workers: int | None, generator: torch.Generator | None = None) -> Iterator[tuple[Tensor, Tensor]]:
    """(images, labels) on `device` for each list of indices in `index_batches`, in order."""
    source = _tensor_source(dataset)
    if source is not None:
        images, remap = source
        return (images.batch(batch if remap is None else [remap[i] for i in batch], device)
                for batch in index_batches)
    loader = DataLoader(dataset, batch_sampler=index_batches, num_workers=resolve_workers(workers),
                        generator=generator, pin_memory=device.type == "cuda")
    return ((images.to(device, non_blocking=True), labels.to(device, non_blocking=True))
            for images, labels in loader)


def _tensor_source(dataset: Dataset) -> tuple[TensorImages, Sequence[int] | None] | None:
    """The tensor set behind `dataset` (itself or a Subset of it) and the Subset's indices, else None."""
    if isinstance(dataset, TensorImages):
        return dataset, None
    if isinstance(dataset, Subset) and isinstance(dataset.dataset, TensorImages):
        return dataset.dataset, dataset.indices
    return None
