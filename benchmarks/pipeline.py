"""The data path's share of a training step: the training pipeline's step time over the bare loop's, on the
default job (`barter train`'s preset, mnist5k_quick).

Pipeline: every epoch of the job as `barter train` runs it (data loading and augmentation, the recipe's
learning rate, FLOP counting, the optimizer step and BARTER's transfers), evaluation and checkpoints left out.
Bare loop: as many steps of forward, loss, backward and optimizer step over the job's final compact model on one
batch already on the device. The ratio (pipeline / bare) is what the pipeline adds; 1.0 would be free.

    .venv/bin/python benchmarks/pipeline.py [--epochs 8] [--threads N] [--device cpu]
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from barter.training.batches import steps_per_epoch
from barter.training.checkpoint import seed_all
from barter.training.loop import _train_epoch
from barter.training.presets import DEFAULT_PRESET, preset
from barter.training.recipe import build_criterion
from barter.training.session import build_data, build_session, resolve_device


def pipeline_step_s(config, device) -> tuple[float, int, object, object]:
    """Mean seconds per step over the job's epochs; also the steps run, the session and the data."""
    data = build_data(config)
    batches = steps_per_epoch(len(data.train), config, data.mixup is not None)
    seed_all(config.seed)
    session = build_session(config, data, device, config.epochs * batches, pretrained=False)
    criterion = build_criterion(config.label_smoothing, data.mixup is not None)
    started = time.perf_counter()
    for _ in range(config.epochs):
        done, _, _ = _train_epoch(session, config, data, criterion, device, batches)
        session.epoch += done / batches
    return (time.perf_counter() - started) / session.step, session.step, session, data


def bare_step_s(session, data, config, device, steps: int) -> float:
    """Mean seconds per step of forward, loss, backward and AdamW step on one batch of the job's compact model."""
    model = copy.deepcopy(session.model)  # the compact model, without the controller's score taps
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    criterion = build_criterion(config.label_smoothing, mixed=False)
    loader = torch.utils.data.DataLoader(data.train, batch_size=config.batch_size)
    images, labels = (t.to(device) for t in next(iter(loader)))
    model.train()

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        criterion(model(images), labels).backward()
        optimizer.step()

    for _ in range(5):
        step()
    _sync(device)
    started = time.perf_counter()
    for _ in range(steps):
        step()
    _sync(device)
    return (time.perf_counter() - started) / steps


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, help="epochs of the job to time (default: all of the preset's)")
    parser.add_argument("--threads", type=int, help="torch threads on CPU (default: torch's)")
    parser.add_argument("--device", default="auto")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    config = replace(preset(DEFAULT_PRESET), progress=False)
    if args.epochs:
        config = replace(config, epochs=args.epochs)
    device = resolve_device(config.device if args.device == "auto" else args.device)
    pipeline, steps, session, data = pipeline_step_s(config, device)
    bare = bare_step_s(session, data, config, device, steps=min(steps, 200))
    print(f"{DEFAULT_PRESET} on {device} ({torch.get_num_threads()} threads, workers {config.workers}): "
          f"{steps} steps")
    print(f"pipeline step {1e3 * pipeline:.1f} ms | bare loop step {1e3 * bare:.1f} ms | "
          f"ratio {pipeline / bare:.2f}")


if __name__ == "__main__":
    main()
