"""The live state of a run: its data sets, and the model, optimizer and training method built for them."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from timm.utils import ModelEmaV3
from torch import Tensor, nn
from torch.utils.data import Dataset, Subset

from ..baselines import build_baseline
from ..compiling import compile_model
from ..controller import Controller
from ..ddp import DistributedModel
from ..fsdp import shard
from ..meta_build import BuildRecord, MetaBuildError, Replayed, materialise, record_build
from ..method import Dense, TrainingMethod
from ..wrapping import wrap
from . import processes
from .config import BASELINE_METHODS, WRAP_METHODS, ConfigError, TrainConfig
from .data import DatasetSpec, build_datasets, build_mixup, resolve_spec
from .evaluation import EVAL_BATCH
from .flops import FlopMeter
from .loading import batches_of
from .precision import Precision, build_precision
from .pretrained import (
    build_model,
    calibration_batches,
    reloads_on_resume,
    warn_of_transfers_from_trained,
    wrap_options,
)
from .recipe import WarmupCosine, build_criterion, build_optimizer


@dataclass
class Data:
    """Train, validation (or None) and test sets, their shape, the recipe's batch mixing, and the data set's spec
    as resolved."""

    train: Dataset
    val: Dataset | None
    test: Dataset
    num_classes: int
    in_chans: int
    img_size: int
    mixup: Any
    spec: DatasetSpec


@dataclass
class Session:
    """The live training state and the counters a checkpoint stores with it."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    method: TrainingMethod  # what steps after every optimizer step (`barter.method`)
    meter: FlopMeter
    schedule: WarmupCosine
    ddp: DistributedModel | None = None  # what training steps run through in a multi-process run
    precision: Precision = field(default_factory=Precision)
    compiled: nn.Module | None = None  # what training steps run through under --compile
    ema: ModelEmaV3 | None = None  # the weights' moving average under --model-ema
    replayed: Replayed | None = None  # how a model built on the meta device was given its values (fsdp_on_meta)
    epoch: float = 0
    step: int = 0
    finished: bool = False
    best_acc: float = -1.0
    best_epoch: float = 0.0
    step_flops: int | None = None  # FLOPs of the latest full-batch step
    wall_s: float = 0.0


def resolve_device(name: str) -> torch.device:
    """`name` as a device ("auto": CUDA if available); under torchrun, "cuda" is the process's own GPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return processes.local_device(torch.device(name))


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
    spec = resolve_spec(config.dataset, config.img_size, config.in_chans, config.normalize_as, config.data_dir)
    mixup = build_mixup(config.recipe or spec.recipe, sets.num_classes, config.label_smoothing)
    if mixup is not None and config.batch_size % 2:
        raise ConfigError(f"batch mixing needs an even batch_size, got {config.batch_size}")
    return Data(train_set, val_set, sets.test, sets.num_classes, sets.in_chans, sets.img_size, mixup, spec)


def build_session(config: TrainConfig, data: Data, device: torch.device, total_steps: int, *,
                  pretrained: bool) -> Session:
    """Model (with `init_from` weights when `pretrained`, or when the wrap chooses units on them:
    `barter.training.pretrained.reloads_on_resume`), optimizer, and the training method; BARTER's controller
    is also followed by the EMA, the DistributedDataParallel wrapper and the compiled model, as its transfers
    resize the model."""
    model, record = _build_model(config, data, device, reload=pretrained or reloads_on_resume(config))
    built_on = torch.device("meta") if record is not None else device
    # under FSDP2 the optimizer is built on the parameters fully_shard makes, after the wrap
    optimizer = None if config.fsdp else build_optimizer(model.parameters(), lr=config.lr,
                                                         weight_decay=config.weight_decay, decay=config.decay)
    try:
        precision = build_precision(config.amp, device)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    controller = None
    method: TrainingMethod = Dense()
    if config.method in WRAP_METHODS:
        warn_of_transfers_from_trained(config)
        method = controller = wrap(model, optimizer, total_steps=total_steps, density=config.density,
                                   method=config.method, seed=config.seed,
                                   example_inputs=example_batch(data, built_on),
                                   auto=False, scaler=precision.scaler,
                                   calibration=calibration_batches(config, data.train, device), **wrap_options(config))
    elif config.method in BASELINE_METHODS:
        method = build_baseline(config.method, model, optimizer, density=config.density, total_steps=total_steps,
                                seed=config.seed, example_inputs=example_batch(data, device),
                                **config.baseline_options)
    # no probe for a sharded model (its forward is collective) nor in a matched-compute continuation (its events are
    # its source run's record: no transfer of its own, and the loss after them measured under another schedule)
    if controller is not None and not config.fsdp and config.continue_from is None:
        controller.watch_transfers(*probe_batch(data, device), build_criterion(config.label_smoothing, mixed=False))
    replayed = None
    if config.fsdp:
        shard(model)
        if record is not None:
            replayed = materialise(model, record, device, controller=controller)
        optimizer = build_optimizer(model.parameters(), lr=config.lr, weight_decay=config.weight_decay,
                                    decay=config.decay)
        method.attach_optimizer(optimizer)
    ema = build_ema(model, controller, config.model_ema)
    warmup = round(config.warmup_epochs * total_steps / config.epochs)
    schedule = WarmupCosine(config.lr, config.min_lr, warmup, total_steps)
    ddp = None
    if processes.world_size() > 1 and not config.fsdp:
        device_ids = [device.index] if device.type == "cuda" else None
        ddp = DistributedModel(model, controller, device_ids=device_ids)
    if config.compile and ddp is not None:
        raise ConfigError("compile runs in one process only")
    compiled = compile_model(model, controller) if config.compile else None
    return Session(model, optimizer, method, FlopMeter(), schedule, ddp, precision=precision, compiled=compiled,
                   ema=ema, replayed=replayed)


def _build_model(config: TrainConfig, data: Data, device: torch.device, *,
                 reload: bool) -> tuple[nn.Module, BuildRecord | None]:
    """The model, with `init_from` weights when `reload`; under `fsdp_on_meta` (and no weights to load) built on the
    meta device, with the record of its build that gives its values once it is sharded."""
    if config.fsdp and config.fsdp_on_meta and not (reload and config.init_from is not None):
        try:
            return record_build(lambda: build_model(config.model, model_arguments(config, data), None))
        except MetaBuildError as e:
            raise ConfigError(f"{config.model}: {e} (--no-fsdp-on-meta)") from e
    model = build_model(config.model, model_arguments(config, data), config.init_from if reload else None)
    return model.to(device), None


def build_ema(model: nn.Module, controller: Controller | None, decay: float | None) -> ModelEmaV3 | None:
    """timm's EMA of `model`'s weights (None without a decay), made after the wrap so that it follows the
    controller's transfers."""
    if decay is None:
        return None
    ema = ModelEmaV3(model, decay=decay)
    if controller is not None:
        controller.track(ema)
    return ema


def model_arguments(config: TrainConfig, data: Data) -> dict[str, Any]:
    """The keyword arguments of `timm.create_model(config.model, ...)`: the data's shape, then the config's own."""
    return {"num_classes": data.num_classes, "in_chans": data.in_chans, "img_size": data.img_size,
            **config.model_kwargs}


def probe_batch(data: Data, device: torch.device) -> tuple[Tensor, Tensor]:
    """The batch a run measures its transfers' loss on (`barter.transfer_probe`): the first evaluation batch of
    the validation split (the test split without one), unaugmented, so the same for every seed and on resume."""
    dataset = data.val if data.val is not None else data.test
    return next(batches_of(dataset, [range(min(EVAL_BATCH, len(dataset)))], device, workers=0))


def example_batch(data: Data, device: torch.device) -> tuple[Tensor]:
    """Two zero images shaped like the data: the example inputs fxsurgery analyses the model on."""
    return (torch.zeros(2, data.in_chans, data.img_size, data.img_size, device=device),)
