"""Training: `train(TrainConfig) -> RunResult` runs the paper's recipe with one method, counts training FLOPs,
writes the run directory (`barter.training.runlog`) and resumes from its checkpoints.

Determinism: the data order of epoch e comes from a generator seeded by (seed, e), and every other random
state is saved at epoch boundaries, so a run resumed from an epoch checkpoint repeats the uninterrupted one.
"""
from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from tqdm import tqdm

from . import processes
from .batches import epoch_batches, granule, steps_per_epoch
from .checkpoint import (
    repair_run,
    restore,
    save_checkpoints,
    save_compact,
    seed_all,
    source_checkpoint,
    write_width_log,
)
from .config import ConfigError, TrainConfig
from .evaluation import evaluate
from .header import describe_run, widths_text
from .loading import batches_of
from .recipe import WarmupCosine, build_criterion
from .runlog import CheckpointError, RunDir, plot_widths
from .session import Data, Session, build_data, build_session, resolve_device
from .transfer_plot import plot_transfers, probed


@dataclass(frozen=True)
class RunResult:
    """Where a run wrote its files and how it ended (acc / macro_f1: the test split at the last epoch;
    best_*: the checkpoint selected on validation, or on test without a validation split; the EMA's accuracy
    under `model_ema`)."""

    run_dir: Path
    epochs: float
    steps: int
    acc: float
    macro_f1: float
    best_acc: float
    best_epoch: float
    flops: int
    wall_s: float
    transfers: int
    already_finished: bool = False  # resumed after it had finished: nothing trained, no file written


def train(config: TrainConfig, *, resume: bool = False, header: Callable[[str], None] | None = None) -> RunResult:
    """Train `config`; with `resume`, continue the run directory `out_dir/name` from its last checkpoint.
    `header` (`barter train`: print) gets the run's description (`barter.training.header`) before the first step.

    Under torchrun every process joins the process group (`barter.training.processes`) and trains a
    DistributedDataParallel replica on its share of every global batch; rank 0 evaluates and writes the run
    directory, every rank restores a resumed run's checkpoint, and every rank returns rank 0's result.
    """
    config.validate()
    device = resolve_device(config.device)
    with processes.process_group(device):
        return _train(config, resume, device, header)


def _train(config: TrainConfig, resume: bool, device: torch.device,
           header: Callable[[str], None] | None) -> RunResult:
    torch.backends.cuda.matmul.allow_tf32 = False  # the paper trains in full FP32
    torch.backends.cudnn.allow_tf32 = False
    data = build_data(config)
    world = processes.world_size()
    if config.batch_size < world * granule(data.mixup is not None):
        raise ConfigError(f"batch_size {config.batch_size} leaves some of the {world} processes no images")
    run = _open_run(config, resume)
    processes.barrier()  # every process has checked the run directory before rank 0 creates it
    config = replace(config, name=run.path.name)
    source = source_checkpoint(config, run, resume)
    if resume and source["finished"] and _complete(run, source):
        return _finished_result(run, source)
    batches_per_epoch = steps_per_epoch(len(data.train), config, data.mixup is not None)
    total_steps = config.epochs * batches_per_epoch
    seed_all(config.seed)
    session = build_session(config, data, device, total_steps, pretrained=source is None)
    with contextlib.closing(session.method):
        if source is not None:
            restore(session, source)
        if config.continue_from is not None and not resume:
            _start_continuation(session, config, batches_per_epoch)
        if processes.is_main():
            if resume:
                repair_run(session, run, source)
            run.write_json("config.json", config.to_dict())
            if header is not None:
                header(describe_run(config, data, session, run.path, resumed=resume))
        criterion = build_criterion(config.label_smoothing, data.mixup is not None)
        started = time.perf_counter() - session.wall_s
        while not session.finished:
            done, loss, acc = train_epoch(session, config, data, criterion, device, batches_per_epoch)
            session.epoch += done / batches_per_epoch
            out_of_budget = not _budget_allows(session, config.flop_budget)
            epochs_done = config.continue_from is None and session.epoch >= config.epochs
            session.finished = done < batches_per_epoch or out_of_budget or epochs_done
            session.wall_s = time.perf_counter() - started
            if processes.is_main() or config.fsdp:  # a sharded model evaluates and saves on every rank
                _end_epoch(session, config, data, run, device, {"loss": loss, "train_acc": acc})
    result = None
    if processes.is_main():
        topology = session.method.topology()
        if topology is not None:
            plot_widths(run.path / "widths.png", topology, session.method.events, batches_per_epoch, session.step,
                        title=f"{run.path.name}: units per layer ({config.method}, density {config.density:g})")
        if probed(session.method.events):
            plot_transfers(run.path / "transfers.png", {run.path.name: session.method.events})
        last = run.metrics()[-1]
        result = RunResult(run.path, session.epoch, session.step, last["acc"], last["macro_f1"], session.best_acc,
                           session.best_epoch, session.meter.total_flops, session.wall_s,
                           sum(e.skipped is None for e in session.method.events))
    return processes.broadcast_from_main(result)


def _complete(run: RunDir, state: dict) -> bool:
    """Whether the run of the finished checkpoint `state` wrote everything after it: its last metrics line and,
    for a method with a topology, widths.png (its last file); a run cut before them is repaired on resume."""
    metrics = run.metrics()
    return bool(metrics) and metrics[-1]["epoch"] == state["epoch"] and (
        not (run.path / "topology.json").exists() or (run.path / "widths.png").exists())


def _finished_result(run: RunDir, state: dict) -> RunResult:
    """The result of a finished run, read from its last checkpoint `state` and its files, none of them written."""
    last = run.metrics()[-1]
    return RunResult(run.path, state["epoch"], state["step"], last["acc"], last["macro_f1"], state["best"]["acc"],
                     state["best"]["epoch"], last["flops"], state["wall_s"],
                     sum(e["skipped"] is None for e in run.events()), already_finished=True)


def _open_run(config: TrainConfig, resume: bool) -> RunDir:
    root = Path(config.out_dir)
    if resume:
        if config.name is None:
            raise ConfigError("resume needs the run's name (its directory under out_dir)")
        return RunDir(root / config.name)
    name = config.name
    if name is None:
        base = config.default_name()
        name = next(n for n in (base, *(f"{base}-{i}" for i in range(2, 10_000))) if not (root / n).exists())
    run = RunDir(root / name)
    if run.path.exists():
        raise ConfigError(f"run directory {run.path} exists; resume it or choose another name")
    return run  # created by its first file, once the checkpoints and the model have been checked


def _start_continuation(session: Session, config: TrainConfig, batches_per_epoch: int) -> None:
    """Matched compute: topology fixed (the controller's window is over) and Adam state kept; a new warmup +
    cosine runs over the steps the remaining budget buys; the best checkpoint is chosen anew."""
    if session.step_flops is None:
        raise CheckpointError(f"{config.continue_from} ran no full batch; its step cost is unknown")
    remaining = config.flop_budget - session.meter.total_flops
    if remaining < session.step_flops:
        raise ConfigError(f"flop_budget {config.flop_budget:.4g} leaves no step to train after "
                          f"{config.continue_from} ({session.meter.total_flops:.4g} FLOPs spent)")
    horizon = max(1, int(remaining // session.step_flops))
    warmup = min(horizon, round(config.warmup_epochs * batches_per_epoch))
    session.schedule = WarmupCosine(config.lr, config.min_lr, warmup, horizon, start=session.step)
    session.finished, session.best_acc, session.best_epoch = False, -1.0, session.epoch


def _budget_allows(session: Session, budget: float | None) -> bool:
    """Whether one more step stays within `budget` (estimated by the latest full-batch step)."""
    return budget is None or session.meter.total_flops + (session.step_flops or 0) <= budget


def train_epoch(session: Session, config: TrainConfig, data: Data, criterion, device: torch.device,
                 batches_per_epoch: int) -> tuple[int, float, float]:
    """One epoch of optimizer steps (fewer if the FLOP budget runs out); returns how many ran, and the mean
    training loss and accuracy (against the unmixed labels).

    With several processes each trains on its share of every global batch (`barter.training.processes.shard`), its
    loss weighted by its share, so the gradient DistributedDataParallel averages is the global batch's; the
    FLOPs counted are the global batch's, the loss and accuracy those of all shares.
    """
    epoch = math.floor(session.epoch)
    generator = torch.Generator().manual_seed(config.seed * 1_000_003 + epoch)
    mixed = data.mixup is not None
    batches = epoch_batches(len(data.train), config, mixed, generator)
    world = processes.world_size()
    if world > 1:
        generator = processes.seed_rank_streams(config.seed, epoch)
    loader = batches_of(data.train, [processes.shard(b, granule(mixed)) for b in batches], device,
                        workers=config.workers, generator=generator)
    model, optimizer, meter = session.model, session.optimizer, session.meter
    net = next(m for m in (session.compiled, session.ddp, model) if m is not None)
    model.train()
    loss_sum = torch.zeros((), device=device)
    correct = torch.zeros((), dtype=torch.long, device=device)
    seen = done = 0
    # a bar on a terminal only: a log file gets the plain per-epoch line of `_end_epoch` alone, no \r updates
    bar = tqdm(total=batches_per_epoch, desc=f"epoch {epoch + 1}", leave=False, dynamic_ncols=True,
               disable=not (config.progress and processes.is_main() and sys.stderr.isatty()))
    for batch, (images, labels) in zip(batches, loader):
        if not _budget_allows(session, config.flop_budget):
            break
        targets = labels
        if data.mixup is not None:
            images, targets = data.mixup(images, labels)
        lr = session.schedule.apply(optimizer, session.step)
        optimizer.zero_grad(set_to_none=True)
        weight = world * len(images) / len(batch)  # 1 for equal shares
        outputs, loss = meter.step(net, images, lambda out, t=targets, w=weight: criterion(out, t) * w,
                                   global_batch=len(batch), autocast=session.precision.autocast,
                                   backward=session.precision.backward)
        session.precision.step(optimizer)
        session.method.step()
        session.step += 1
        if session.ema is not None:
            session.ema.update(model, step=session.step)
        done += 1
        if len(batch) == config.batch_size:
            session.step_flops = meter.last.total
        loss_sum += loss.detach() * (len(images) / weight)
        correct += (outputs.argmax(1) == labels).sum()
        seen += len(images)
        bar.update()
        if done % 10 == 0 or done == batches_per_epoch:
            bar.set_postfix_str(f"loss {loss_sum.item() / seen:.3f} acc {correct.item() / seen:.3f} "
                                f"lr {lr:.2e}{widths_text(session.method.topology())}")
    bar.close()
    loss_total, correct_total, seen_total = processes.sum_over_ranks([loss_sum.item(), correct.item(), seen])
    return done, loss_total / max(1, seen_total), correct_total / max(1, seen_total)


def _end_epoch(session: Session, config: TrainConfig, data: Data, run: RunDir, device: torch.device,
               train_stats: dict[str, float]) -> None:
    """Evaluate (the EMA too, which then selects the best checkpoint), log the epoch (with the method's
    `metrics()`), keep the best and the last checkpoint, and write the method's events and topology. At the end
    of a run whose method exports a smaller model than it trains (S²ViTE), the selected model's compact export
    goes to `run/compact` and its parameter count into the last record. Under `fsdp` every rank evaluates and
    saves (collectives), and rank 0 alone writes the rest."""
    test = evaluate(session.model, data.test, data.num_classes, device, config.workers)
    val = evaluate(session.model, data.val, data.num_classes, device, config.workers) if data.val is not None else None
    record = {"epoch": session.epoch, "step": session.step, **train_stats,
              "test_loss": test["loss"], "acc": test["acc"], "top5": test["top5"], "macro_f1": test["macro_f1"],
              "lr": session.optimizer.param_groups[0]["lr"], "flops": session.meter.total_flops,
              "flops_per_image": session.meter.last.estimated_flops_per_image if session.meter.last else None,
              "wall_s": session.wall_s}
    if val is not None:
        record.update(val_loss=val["loss"], val_acc=val["acc"], val_macro_f1=val["macro_f1"])
    ema_test = ema_val = None
    if session.ema is not None:
        ema_test = evaluate(session.ema.module, data.test, data.num_classes, device, config.workers)
        record.update({f"ema_test_{k}": v for k, v in ema_test.items()})
        if data.val is not None:
            ema_val = evaluate(session.ema.module, data.val, data.num_classes, device, config.workers)
            record.update({f"ema_val_{k}": v for k, v in ema_val.items()})
    record.update(session.method.metrics())
    selected = (ema_val or ema_test or val or test)["acc"]
    improved = selected > session.best_acc
    if improved:
        session.best_acc, session.best_epoch = selected, session.epoch
    save_checkpoints(session, config, data, run, improved, record=record)
    if not processes.is_main():
        return
    compact_parameters = save_compact(session, config, data, run) if session.finished else None
    if compact_parameters is not None:
        record["compact_parameters"] = compact_parameters
    run.append_metrics(record)
    write_width_log(session.method, run)
    if config.progress:
        ema_text = "" if ema_test is None else f"  EMA test acc {ema_test['acc']:.4f}"
        tqdm.write(f"epoch {session.epoch:g}: loss {record['loss']:.4f}  test acc {test['acc']:.4f}  "
                   f"macro-F1 {test['macro_f1']:.4f}  F_total {record['flops']:.4g}  {session.wall_s:.0f}s"
                   f"{ema_text}{widths_text(session.method.topology())}")
