"""Training: `train(TrainConfig) -> RunResult` runs the paper's recipe with one method, counts training FLOPs,
writes the run directory (barter.runlog) and resumes from its checkpoints.

Methods: "dense" (no wrap at all), "static", "barter", "random_receiver", "random_donor", "random_pair"
(`barter.wrap`), and "rigl" / "set" through `barter.sparse.build_sparse` when that module exists.
Determinism: the data order of epoch e comes from a generator seeded by (seed, e), and every other random
state is saved at epoch boundaries, so a run resumed from an epoch checkpoint repeats the uninterrupted one.
"""
from __future__ import annotations

import importlib
import json
import math
import random
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import numpy as np
import timm
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, Subset
from tqdm import tqdm

import models  # noqa: F401  (registers the project's models with timm)

from . import distributed, wrap
from .controller import Controller
from .data import DATASETS, RECIPES, build_datasets, build_mixup, resolve_spec
from .flops import FlopMeter
from .recipe import DECAYS, WarmupCosine, build_criterion, build_optimizer
from .runlog import CheckpointError, RunDir, find_checkpoint, load_checkpoint, plot_widths

WRAP_METHODS = ("static", "barter", "random_receiver", "random_donor", "random_pair")
SPARSE_METHODS = ("rigl", "set")
METHODS = ("dense", *WRAP_METHODS, *SPARSE_METHODS)
EVAL_BATCH = 256
# config fields that may change between a checkpoint and the run that resumes or continues it
RUNTIME_FIELDS = frozenset({"device", "workers", "progress", "out_dir", "name", "data_dir"})
CONTINUATION_FIELDS = frozenset({"continue_from", "flop_budget"})


class ConfigError(ValueError):
    """A configuration that cannot be trained; the message names the field and the reason."""


@dataclass
class TrainConfig:
    """Everything a run depends on. Presets (`barter.presets`) fill it; the CLI overrides single fields.

    Data: `val_size` training images (a fixed split) are held out to select the best checkpoint; with 0 the
    test split selects it. An epoch is `passes` shuffled passes; `drop_last` drops the final incomplete batch
    (an odd one is always dropped when batches are mixed). Optimisation: see `barter.recipe`; `decay` is
    "after" (CCT) or "before" (ViT). Compute: `flop_budget` stops at that cumulative F_total (a final partial
    epoch allowed); `continue_from` continues a finished run's endpoint up to `flop_budget` (matched compute).
    """

    preset: str = "custom"
    model: str = "cct_2_3x1_32_tiny"
    model_kwargs: dict[str, Any] = field(default_factory=dict)
    init_from: str | None = None
    dataset: str = "fake"
    data_dir: str = "data"
    img_size: int | None = None
    in_chans: int | None = None
    normalize_as: str | None = None
    recipe: str | None = None
    fake_size: int = 256
    val_size: int = 0
    passes: int = 1
    drop_last: bool = False
    batch_size: int = 128
    workers: int = 0
    epochs: int = 10
    lr: float = 1e-3
    min_lr: float = 1e-5
    warmup_epochs: float = 1.0
    weight_decay: float = 0.05
    decay: str = "after"
    label_smoothing: float = 0.1
    method: str = "barter"
    density: float = 0.3
    barter_options: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    device: str = "auto"
    flop_budget: float | None = None
    continue_from: str | None = None
    out_dir: str = "runs"
    name: str | None = None
    progress: bool = True

    def validate(self) -> None:
        """Raise ConfigError for a value training cannot use."""
        checks = [
            (self.method in METHODS, f"method must be one of {', '.join(METHODS)}, got {self.method!r}"),
            (0 < self.density <= 1, f"density must be in (0, 1], got {self.density}"),
            (self.epochs >= 1, f"epochs must be >= 1, got {self.epochs}"),
            (self.batch_size >= 1, f"batch_size must be >= 1, got {self.batch_size}"),
            (self.passes >= 1, f"passes must be >= 1, got {self.passes}"),
            (self.val_size >= 0, f"val_size must be >= 0, got {self.val_size}"),
            (self.lr > 0 and self.min_lr >= 0, f"lr must be > 0 and min_lr >= 0, got {self.lr}, {self.min_lr}"),
            (self.warmup_epochs >= 0, f"warmup_epochs must be >= 0, got {self.warmup_epochs}"),
            (self.weight_decay >= 0, f"weight_decay must be >= 0, got {self.weight_decay}"),
            (0 <= self.label_smoothing < 1, f"label_smoothing must be in [0, 1), got {self.label_smoothing}"),
            (self.decay in DECAYS, f"decay must be one of {DECAYS}, got {self.decay!r}"),
            (self.dataset in DATASETS, f"dataset must be one of {', '.join(DATASETS)}, got {self.dataset!r}"),
            (self.recipe is None or self.recipe in RECIPES, f"recipe must be one of {RECIPES}, got {self.recipe!r}"),
            (self.flop_budget is None or self.flop_budget > 0, f"flop_budget must be > 0, got {self.flop_budget}"),
            (self.continue_from is None or self.flop_budget is not None,
             "continue_from needs flop_budget (the baseline's cumulative training FLOPs)"),
            (self.continue_from is None or self.method not in SPARSE_METHODS,
             "continue_from fixes a BARTER topology; it does not apply to rigl/set"),
            (self.workers >= 0, f"workers must be >= 0, got {self.workers}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)
        if self.model not in timm.list_models():
            raise ConfigError(f"unknown model {self.model!r} (not in timm's registry)")

    def to_dict(self) -> dict[str, Any]:
        """JSON-normal dictionary (tuples become lists), as config.json and checkpoints store it."""
        return json.loads(json.dumps(asdict(self)))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        unknown = sorted(set(data) - {f.name for f in fields(cls)})
        if unknown:
            raise ConfigError(f"unknown config field(s): {', '.join(unknown)}")
        return cls(**data)

    def default_name(self) -> str:
        rho = "" if self.method == "dense" else f"-rho{self.density:g}"
        suffix = "-matched" if self.continue_from else ""
        return f"{self.preset}-{self.method}{rho}-seed{self.seed}{suffix}"


@dataclass(frozen=True)
class RunResult:
    """Where a run wrote its files and how it ended (acc / macro_f1: the test split at the last epoch;
    best_*: the checkpoint selected on validation, or on test without a validation split)."""

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


@dataclass
class Data:
    """Train, validation (or None) and test sets, their shape, and the recipe's batch mixing."""

    train: Dataset
    val: Dataset | None
    test: Dataset
    num_classes: int
    in_chans: int
    img_size: int
    mixup: Any


@dataclass
class Session:
    """The live training state and the counters a checkpoint stores with it."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    controller: Controller | None
    sparse: Any
    meter: FlopMeter
    schedule: WarmupCosine
    ddp: distributed.DistributedModel | None = None  # what training steps run through in a multi-process run
    epoch: float = 0
    step: int = 0
    finished: bool = False
    best_acc: float = -1.0
    best_epoch: float = 0.0
    step_flops: int | None = None  # FLOPs of the latest full-batch step
    wall_s: float = 0.0


def train(config: TrainConfig, *, resume: bool = False) -> RunResult:
    """Train `config`; with `resume`, continue the run directory `out_dir/name` from its last checkpoint.

    Under torchrun every process joins the process group (`barter.distributed`) and trains a
    DistributedDataParallel replica on its share of every global batch; rank 0 evaluates and writes the run
    directory, every rank restores a resumed run's checkpoint, and every rank returns rank 0's result.
    """
    config.validate()
    device = resolve_device(config.device)
    with distributed.process_group(device):
        return _train(config, resume, device)


def _train(config: TrainConfig, resume: bool, device: torch.device) -> RunResult:
    torch.backends.cuda.matmul.allow_tf32 = False  # the paper trains in full FP32
    torch.backends.cudnn.allow_tf32 = False
    data = build_data(config)
    processes = distributed.world_size()
    if config.batch_size < processes * _granule(data.mixup is not None):
        raise ConfigError(f"batch_size {config.batch_size} leaves some of the {processes} processes no images")
    run = _open_run(config, resume)
    distributed.barrier()  # every process has checked the run directory before rank 0 creates it
    config = replace(config, name=run.path.name)
    source = _source_checkpoint(config, run, resume)
    batches_per_epoch = steps_per_epoch(len(data.train), config, data.mixup is not None)
    total_steps = config.epochs * batches_per_epoch
    _seed_all(config.seed)
    session = build_session(config, data, device, total_steps, pretrained=source is None)
    if source is not None:
        restore(session, source)
    if config.continue_from is not None and not resume:
        _start_continuation(session, config, batches_per_epoch)
    if distributed.is_main():
        if resume:
            run.truncate_metrics(session.epoch)
        run.write_json("config.json", config.to_dict())
    criterion = build_criterion(config.label_smoothing, data.mixup is not None)
    started = time.perf_counter() - session.wall_s
    while not session.finished:
        done, loss, acc = _train_epoch(session, config, data, criterion, device, batches_per_epoch)
        session.epoch += done / batches_per_epoch
        out_of_budget = not _budget_allows(session, config.flop_budget)
        epochs_done = config.continue_from is None and session.epoch >= config.epochs
        session.finished = done < batches_per_epoch or out_of_budget or epochs_done
        session.wall_s = time.perf_counter() - started
        if distributed.is_main():
            _end_epoch(session, config, data, run, device, {"loss": loss, "train_acc": acc})
    result = None
    if distributed.is_main():
        if session.controller is not None:
            plot_widths(run.path / "widths.png", session.controller.topology(), session.controller.events,
                        batches_per_epoch, session.step)
        last = run.metrics()[-1]
        events = session.controller.events if session.controller is not None else []
        result = RunResult(run.path, session.epoch, session.step, last["acc"], last["macro_f1"], session.best_acc,
                           session.best_epoch, session.meter.total_flops, session.wall_s,
                           sum(e["skipped"] is None for e in events))
    return distributed.broadcast_from_main(result)


def resolve_device(name: str) -> torch.device:
    """`name` as a device ("auto": CUDA if available); under torchrun, "cuda" is the process's own GPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return distributed.local_device(torch.device(name))


def build_data(config: TrainConfig) -> Data:
    """The data sets of `config`; a validation split (fixed, independent of the seed) when `val_size` > 0."""
    args = {"img_size": config.img_size, "in_chans": config.in_chans, "normalize_as": config.normalize_as,
            "fake_size": config.fake_size}
    sets = build_datasets(config.dataset, config.data_dir, recipe=config.recipe, **args)
    train_set, val_set = sets.train, None
    if config.val_size:
        if config.val_size >= len(sets.train):
            raise ConfigError(f"val_size {config.val_size} leaves no training images (of {len(sets.train)})")
        plain = build_datasets(config.dataset, config.data_dir, recipe="none", **args).train
        order = torch.randperm(len(plain), generator=torch.Generator().manual_seed(0)).tolist()
        val_set, train_set = Subset(plain, order[:config.val_size]), Subset(sets.train, order[config.val_size:])
    spec = resolve_spec(config.dataset, config.img_size, config.in_chans, config.normalize_as)
    mixup = build_mixup(config.recipe or spec.recipe, sets.num_classes, config.label_smoothing)
    if mixup is not None and config.batch_size % 2:
        raise ConfigError(f"batch mixing needs an even batch_size, got {config.batch_size}")
    return Data(train_set, val_set, sets.test, sets.num_classes, sets.in_chans, sets.img_size, mixup)


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
    return config.drop_last or (mixed and rest % 2 == 1) or rest < distributed.world_size() * _granule(mixed)


def _granule(mixed: bool) -> int:
    """Images of a batch that go to one process together: pairs when batch mixing pairs them up."""
    return 2 if mixed else 1


def build_session(config: TrainConfig, data: Data, device: torch.device, total_steps: int, *,
                  pretrained: bool) -> Session:
    """Model (with `init_from` weights when `pretrained`), optimizer, and the method's wrapper."""
    model = timm.create_model(config.model, **model_arguments(config, data)).to(device)
    if pretrained and config.init_from is not None:
        load_pretrained(model, config.init_from)
    optimizer = build_optimizer(model.parameters(), lr=config.lr, weight_decay=config.weight_decay,
                                decay=config.decay)
    controller = sparse = None
    if config.method in WRAP_METHODS:
        example = example_batch(data, device)
        controller = wrap(model, optimizer, total_steps=total_steps, density=config.density,
                          method=config.method, seed=config.seed, example_inputs=example, **config.barter_options)
    elif config.method in SPARSE_METHODS:
        sparse = _sparse_module().build_sparse(model, optimizer, method=config.method, density=config.density,
                                               total_steps=total_steps, seed=config.seed)
    warmup = round(config.warmup_epochs * total_steps / config.epochs)
    schedule = WarmupCosine(config.lr, config.min_lr, warmup, total_steps)
    ddp = None
    if distributed.world_size() > 1:
        device_ids = [device.index] if device.type == "cuda" else None
        ddp = distributed.DistributedModel(model, controller, device_ids=device_ids)
    return Session(model, optimizer, controller, sparse, FlopMeter(), schedule, ddp)


def _sparse_module():
    try:
        return importlib.import_module("barter.sparse")
    except ModuleNotFoundError as e:
        if e.name != "barter.sparse":
            raise
        raise ConfigError("rigl/set need barter.sparse, which is not installed in this checkout") from e


def load_pretrained(model: nn.Module, source: str) -> None:
    """Load a dense run's weights (its best checkpoint, or a checkpoint directory) except the classifier, which
    stays freshly initialised for the new classes. Sparse methods then keep a subset of these weights."""
    path = find_checkpoint(source, "best")
    state = load_checkpoint(path)
    if state.get("controller") is not None or state.get("sparse") is not None:
        raise CheckpointError(f"{path}: init_from needs a dense run's checkpoint (this one is compact or sparse)")
    head = model.pretrained_cfg.get("classifier", "head") + "."
    weights = {k: v for k, v in state["model"].items() if not k.startswith(head)}
    try:
        missing, unexpected = model.load_state_dict(weights, strict=False)
    except RuntimeError as e:
        raise CheckpointError(f"{path}: weights do not fit {type(model).__name__}: {e}") from e
    wrong = unexpected + [k for k in missing if not k.startswith(head)]
    if wrong:
        raise CheckpointError(f"{path}: weights do not fit the model (mismatched keys: {wrong[:5]})")


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


def _source_checkpoint(config: TrainConfig, run: RunDir, resume: bool) -> dict[str, Any] | None:
    """The checkpoint to start from: the run's own (resume), the endpoint to continue, or None."""
    if resume:
        state = load_checkpoint(run.last)
        check_compatible(state["config"], config, RUNTIME_FIELDS)
    elif config.continue_from is not None:
        state = load_checkpoint(find_checkpoint(config.continue_from, "last"))
        check_compatible(state["config"], config, RUNTIME_FIELDS | CONTINUATION_FIELDS)
        if not state["finished"]:
            raise CheckpointError(f"{config.continue_from} has not finished; resume it before continuing it")
    else:
        return None
    return state


def check_compatible(saved: dict[str, Any], config: TrainConfig, ignore: frozenset[str]) -> None:
    """Raise CheckpointError unless the checkpoint's config equals `config` outside `ignore`."""
    current = config.to_dict()
    diffs = [f"{k}={saved.get(k)!r} in the checkpoint, {v!r} now" for k, v in current.items()
             if k not in ignore and saved.get(k) != v]
    if diffs:
        raise CheckpointError("checkpoint made with another configuration: " + "; ".join(diffs))


def restore(session: Session, state: dict[str, Any]) -> None:
    """Load a checkpoint into a freshly built session (controller first: it restores the saved widths)."""
    try:
        if session.controller is not None:
            session.controller.load_state_dict(state["controller"])
        session.model.load_state_dict(state["model"])
        session.optimizer.load_state_dict(state["optimizer"])
        if session.sparse is not None:
            session.sparse.load_state_dict(state["sparse"])
        session.meter.load_state_dict(state["flops"])
        session.schedule = WarmupCosine(**state["schedule"])
        session.epoch, session.step, session.finished = state["epoch"], state["step"], state["finished"]
        session.best_acc, session.best_epoch = state["best"]["acc"], state["best"]["epoch"]
        session.step_flops, session.wall_s = state["step_flops"], state["wall_s"]
        set_rng_state(state["rng"])
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"checkpoint does not fit this run ({type(e).__name__}: {e})") from e


def model_arguments(config: TrainConfig, data: Data) -> dict[str, Any]:
    """The keyword arguments of `timm.create_model(config.model, ...)`: the data's shape, then the config's own."""
    return {"num_classes": data.num_classes, "in_chans": data.in_chans, "img_size": data.img_size,
            **config.model_kwargs}


def example_batch(data: Data, device: torch.device) -> tuple[Tensor]:
    """Two zero images shaped like the data: the example inputs fxsurgery analyses the model on."""
    return (torch.zeros(2, data.in_chans, data.img_size, data.img_size, device=device),)


def save_checkpoints(session: Session, config: TrainConfig, data: Data, run: RunDir, improved: bool) -> None:
    """Export the model to the run's last checkpoint with the trainer state beside it (`barter.runlog`), and
    copy it to the best one when it improved: `barter.load(run / "best")` gives the selected model."""
    run.save_checkpoint(run.last, session.model, checkpoint_state(session, config), architecture=config.model,
                        model_kwargs=model_arguments(config, data),
                        example_inputs=example_batch(data, torch.device("cpu")))
    if improved:
        run.copy_checkpoint(run.last, run.best)


def checkpoint_state(session: Session, config: TrainConfig) -> dict[str, Any]:
    """What resuming needs besides the weights: optimizer, controller and sparse states, FLOP meter, counters,
    learning-rate schedule, best result, random states and the config."""
    return {
        "config": config.to_dict(), "epoch": session.epoch, "step": session.step, "finished": session.finished,
        "schedule": asdict(session.schedule), "optimizer": session.optimizer.state_dict(),
        "controller": None if session.controller is None else session.controller.state_dict(),
        "sparse": None if session.sparse is None else session.sparse.state_dict(),
        "flops": session.meter.state_dict(), "step_flops": session.step_flops, "wall_s": session.wall_s,
        "best": {"acc": session.best_acc, "epoch": session.best_epoch}, "rng": rng_state(),
    }


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


def _train_epoch(session: Session, config: TrainConfig, data: Data, criterion, device: torch.device,
                 batches_per_epoch: int) -> tuple[int, float, float]:
    """One epoch of optimizer steps (fewer if the FLOP budget runs out); returns how many ran, and the mean
    training loss and accuracy (against the unmixed labels).

    With several processes each trains on its share of every global batch (`barter.distributed.shard`), its
    loss weighted by its share, so the gradient DistributedDataParallel averages is the global batch's; the
    FLOPs counted are the global batch's, the loss and accuracy those of all shares.
    """
    epoch = math.floor(session.epoch)
    generator = torch.Generator().manual_seed(config.seed * 1_000_003 + epoch)
    mixed = data.mixup is not None
    batches = epoch_batches(len(data.train), config, mixed, generator)
    world = distributed.world_size()
    if world > 1:
        generator = distributed.seed_rank_streams(config.seed, epoch)
    loader = DataLoader(data.train, batch_sampler=[distributed.shard(b, _granule(mixed)) for b in batches],
                        num_workers=config.workers, generator=generator, pin_memory=device.type == "cuda")
    model, optimizer, meter = session.model, session.optimizer, session.meter
    net = model if session.ddp is None else session.ddp
    model.train()
    loss_sum = torch.zeros((), device=device)
    correct = torch.zeros((), dtype=torch.long, device=device)
    seen = done = 0
    bar = tqdm(total=batches_per_epoch, desc=f"epoch {epoch + 1}", leave=False, dynamic_ncols=True,
               disable=not (config.progress and distributed.is_main()))
    for batch, (images, labels) in zip(batches, loader):
        if not _budget_allows(session, config.flop_budget):
            break
        images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        targets = labels
        if data.mixup is not None:
            images, targets = data.mixup(images, labels)
        lr = session.schedule.apply(optimizer, session.step)
        optimizer.zero_grad(set_to_none=True)
        weight = world * len(images) / len(batch)  # 1 for equal shares
        outputs, loss = meter.step(net, images, lambda out, t=targets, w=weight: criterion(out, t) * w,
                                   global_batch=len(batch))
        optimizer.step()  # the controller's transfers run from its post-step hook
        if session.sparse is not None:
            session.sparse.step()
        session.step += 1
        done += 1
        if len(batch) == config.batch_size:
            session.step_flops = meter.last.total
        loss_sum += loss.detach() * (len(images) / weight)
        correct += (outputs.argmax(1) == labels).sum()
        seen += len(images)
        bar.update()
        if done % 10 == 0 or done == batches_per_epoch:
            bar.set_postfix_str(f"loss {loss_sum.item() / seen:.3f} acc {correct.item() / seen:.3f} "
                                f"lr {lr:.2e}{widths_text(session.controller)}")
    bar.close()
    loss_total, correct_total, seen_total = distributed.sum_over_ranks([loss_sum.item(), correct.item(), seen])
    return done, loss_total / max(1, seen_total), correct_total / max(1, seen_total)


def widths_text(controller: Controller | None) -> str:
    """Current per-layer widths for the progress bar, e.g. " | heads 1-2 | channels 38-39"."""
    if controller is None:
        return ""
    topology = controller.topology().values()
    return "".join(f" | {label} " + "-".join(str(t[kind]) for t in topology if kind in t)
                   for kind, label in (("head", "heads"), ("channel", "channels")))


@torch.no_grad()
def evaluate(model: nn.Module, dataset: Dataset, num_classes: int, device: torch.device, workers: int
             ) -> dict[str, float]:
    """Cross-entropy, accuracy and macro-F1 of `model` on `dataset` (eval mode, batches of 256)."""
    model.eval()
    outputs, labels = [], []
    for images, target in DataLoader(dataset, batch_size=EVAL_BATCH, num_workers=workers):
        outputs.append(model(images.to(device)).float().cpu())
        labels.append(target)
    model.train()
    logits, target = torch.cat(outputs), torch.cat(labels)
    pred = logits.argmax(1)
    return {"loss": nn.functional.cross_entropy(logits, target).item(),
            "acc": (pred == target).double().mean().item(), "macro_f1": macro_f1(pred, target, num_classes)}


def macro_f1(pred: Tensor, target: Tensor, num_classes: int) -> float:
    """Unweighted mean of per-class F1 = 2TP / (2TP + FP + FN) over the classes that occur in the targets or
    the predictions (scikit-learn's "macro" average)."""
    confusion = torch.bincount(target * num_classes + pred, minlength=num_classes ** 2).view(num_classes, -1)
    tp = confusion.diag().double()
    occurrences = (confusion.sum(0) + confusion.sum(1)).double()  # 2TP + FP + FN
    present = occurrences > 0
    return (2 * tp[present] / occurrences[present]).mean().item()


def _end_epoch(session: Session, config: TrainConfig, data: Data, run: RunDir, device: torch.device,
               train_stats: dict[str, float]) -> None:
    """Evaluate, log the epoch, keep the best and the last checkpoint, and write events and topology."""
    test = evaluate(session.model, data.test, data.num_classes, device, config.workers)
    val = evaluate(session.model, data.val, data.num_classes, device, config.workers) if data.val is not None else None
    record = {"epoch": session.epoch, "step": session.step, **train_stats,
              "test_loss": test["loss"], "acc": test["acc"], "macro_f1": test["macro_f1"],
              "lr": session.optimizer.param_groups[0]["lr"], "flops": session.meter.total_flops,
              "flops_per_image": session.meter.last.estimated_flops_per_image if session.meter.last else None,
              "wall_s": session.wall_s}
    if val is not None:
        record.update(val_loss=val["loss"], val_acc=val["acc"], val_macro_f1=val["macro_f1"])
    selected = (val or test)["acc"]
    improved = selected > session.best_acc
    if improved:
        session.best_acc, session.best_epoch = selected, session.epoch
    save_checkpoints(session, config, data, run, improved)
    run.append_metrics(record)
    if session.controller is not None:
        run.write_events(session.controller.events)
        run.write_json("topology.json", session.controller.topology())
    if config.progress:
        tqdm.write(f"epoch {session.epoch:g}: loss {record['loss']:.4f}  test acc {test['acc']:.4f}  "
                   f"macro-F1 {test['macro_f1']:.4f}  F_total {record['flops']:.4g}  {session.wall_s:.0f}s"
                   f"{widths_text(session.controller)}")


def rng_state() -> dict[str, Any]:
    """torch (CPU and CUDA), NumPy and Python random states, in types `torch.load(weights_only=True)` reads."""
    _, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "numpy": {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": pos, "has_gauss": has_gauss,
                      "gauss": gauss},
            "python": random.getstate()}


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    np_state = state["numpy"]
    np.random.set_state(("MT19937", np_state["keys"].numpy().astype(np.uint32), np_state["pos"],
                         np_state["has_gauss"], np_state["gauss"]))
    random.setstate(state["python"])


def _seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)
