"""The data path's share of a training step: the training pipeline's step time over the bare loop's, on the
default job (`barter train`'s preset, mnist5k_quick).

Pipeline: every epoch of the job as `barter train` runs it (data loading and augmentation, the recipe's
learning rate, FLOP counting, the optimizer step and BARTER's score taps and transfers), evaluation and
checkpoints left out. Bare loop: after each epoch, as many steps of forward, loss, backward and optimizer step
(the recipe's) over a copy of the epoch's compact model on one batch already on the device. The two alternate
epoch by epoch, so drifting machine load hits them alike. The ratio (pipeline / bare) is what the pipeline
adds to the model's own work; 1.0 would be free.

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
from barter.training.loop import train_epoch
from barter.training.presets import DEFAULT_PRESET, preset
from barter.training.recipe import build_criterion, build_optimizer
from barter.training.session import build_data, build_session, resolve_device

WARMUP_STEPS = 3


def bare_steps_s(model: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor, config, steps: int,
                 device: torch.device) -> float:
    """Seconds of `steps` steps of forward, loss, backward and optimizer step of a copy of `model` on one batch."""
    model = copy.deepcopy(model)  # the compact model, without the controller's score taps
    optimizer = build_optimizer(model.parameters(), lr=config.lr, weight_decay=config.weight_decay,
                                decay=config.decay)
    criterion = build_criterion(config.label_smoothing, mixed=False)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        criterion(model(images), labels).backward()
        optimizer.step()

    for _ in range(WARMUP_STEPS):
        step()
    _sync(device)
    started = time.perf_counter()
    for _ in range(steps):
        step()
    _sync(device)
    return time.perf_counter() - started


def measure(config, device: torch.device) -> tuple[float, float, int]:
    """(pipeline, bare) seconds per step over the job's epochs, and the steps run."""
    data = build_data(config)
    batches = steps_per_epoch(len(data.train), config, data.mixup is not None)
    loader = torch.utils.data.DataLoader(data.train, batch_size=config.batch_size)
    images, labels = (t.to(device) for t in next(iter(loader)))
    seed_all(config.seed)
    session = build_session(config, data, device, config.epochs * batches, pretrained=False)
    criterion = build_criterion(config.label_smoothing, data.mixup is not None)
    pipeline = bare = 0.0
    for _ in range(config.epochs):
        started = time.perf_counter()
        done, _, _ = train_epoch(session, config, data, criterion, device, batches)
        _sync(device)
        pipeline += time.perf_counter() - started
        session.epoch += done / batches
        rng = torch.get_rng_state()
        bare += bare_steps_s(session.model, images, labels, config, done, device)
        torch.set_rng_state(rng)  # the job's stream goes on as if the bare loop had not run
    return pipeline / session.step, bare / session.step, session.step


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
    pipeline, bare, steps = measure(config, device)
    print(f"{DEFAULT_PRESET} on {device} ({torch.get_num_threads()} threads): {steps} steps")
    print(f"pipeline step {1e3 * pipeline:.1f} ms | bare loop step {1e3 * bare:.1f} ms | ratio {pipeline / bare:.2f}")


if __name__ == "__main__":
    main()
