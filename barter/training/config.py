"""What a training run depends on: `TrainConfig`, its checks, and the methods it can train.

Methods: "dense" (no wrap at all), the methods of `barter.wrap` ("static", "barter" and the random ablations),
and the baselines of `barter.baselines` ("rigl", "set", "snfs", "srigl", "s2vite"). A bad value raises
`ConfigError` naming the field.
"""
from __future__ import annotations

import json
import sys
import typing
from collections.abc import Collection
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from ..method_names import REGISTRY, Family, named
from ..options import RANKED_INITS, Options
from .fieldtypes import FieldValueError, coerce
from .specs import DATASETS, FOLDER, READS_NO_FILES, RECIPES, is_folder_tree

WRAP_METHODS, BASELINE_METHODS = named(Family.WRAP), named(Family.BASELINE)
DECAYS = ("before", "after")  # weight decay before (AdamW) or after the Adam update (`barter.training.recipe`)
AMP_MODES = ("fp32", "bf16", "fp16")  # mixed precision of a run (`barter.training.precision`)
METHODS = tuple(REGISTRY)  # every method a run trains (`barter.method_names`)
CHOICES: dict[str, tuple[str, ...]] = {"method": METHODS, "dataset": DATASETS, "recipe": RECIPES, "decay": DECAYS,
                                       "amp": AMP_MODES}


class ConfigError(ValueError):
    """A configuration that cannot be trained; the message names the field and the reason."""


@dataclass
class TrainConfig:
    """Everything a run depends on. Presets (`barter.training.presets`) fill it; the CLI overrides single fields.

    Data: `val_size` training images (a fixed split) are held out to select the best checkpoint; with 0 the
    test split selects it. An epoch is `passes` shuffled passes; `drop_last` drops the final incomplete batch
    (an odd one is always dropped when batches are mixed). Method: `barter_options` go to `barter.wrap`,
    `baseline_options` to the baseline's factory (`barter.baselines.baseline_options(method)` lists them).
    `calibration`: the training batches (unmixed, in a fixed order) that `barter_options` init "score" measures
    each unit's D on, after `init_from` is loaded.
    Optimisation: see `barter.training.recipe`; `decay` is "after" (CCT) or "before" (ViT). Compute:
    `flop_budget` stops at that cumulative F_total (a final partial epoch allowed); `continue_from` continues a
    finished run's endpoint up to `flop_budget` (matched compute). `amp`: "fp32" (the paper's), "bf16" autocast,
    or "fp16" autocast with loss scaling (`barter.training.precision`). `compile`: training steps run through
    `torch.compile` (`barter.compiling.compile_model`; one process only). `fsdp`: under torchrun the model is
    sharded with FSDP2 after the wrap (`barter.fsdp`), and checkpoints are written by every process through
    `torch.distributed.checkpoint` beside rank 0's export of the whole model; `fsdp_on_meta` (the default) builds
    and wraps it on the meta device and writes each process's shards of the values the whole build would have
    drawn (`barter.meta_build`: no process holds the whole model; the same numbers), False builds it whole on
    every process first (as does a start from `init_from`). `model_ema`: the decay of a timm
    `ModelEmaV3` of the weights, updated after every optimizer step, evaluated beside the model, selecting the
    best checkpoint and exported in the checkpoints (timm train.py's `--model-ema`).
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
    workers: int | None = None
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
    calibration: int | None = None
    baseline_options: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    device: str = "auto"
    amp: str = "fp32"
    compile: bool = False
    fsdp: bool = False
    fsdp_on_meta: bool = True
    model_ema: float | None = None
    flop_budget: float | None = None
    continue_from: str | None = None
    out_dir: str = "runs"
    name: str | None = None
    progress: bool = True

    def validate(self) -> None:
        """Raise ConfigError for a value training cannot use (first its type, then its range)."""
        for name, hint in field_types().items():
            try:
                coerce(name, hint, getattr(self, name))
            except FieldValueError as e:
                raise ConfigError(str(e)) from None
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
            (self.continue_from is None or self.method not in BASELINE_METHODS,
             f"continue_from fixes a BARTER topology; it does not apply to {self.method}"),
            (not self.baseline_options or self.method in BASELINE_METHODS,
             f"baseline_options apply to the baselines ({', '.join(BASELINE_METHODS)}), not to {self.method}"),
            (self.workers is None or self.workers >= 0, f"workers must be >= 0, got {self.workers}"),
            (self.amp in AMP_MODES, f"amp must be one of {', '.join(AMP_MODES)}, got {self.amp!r}"),
            (self.model_ema is None or 0 < self.model_ema < 1, f"model_ema must be in (0, 1), got {self.model_ema}"),
            (not self.fsdp or self.method not in BASELINE_METHODS,
             f"fsdp shards BARTER's compact model or a dense one, not the masks of {self.method}"),
            (not self.fsdp or not (self.compile or self.model_ema is not None or self.amp == "fp16"),
             "fsdp runs without compile, model_ema and fp16 loss scaling"),
            (not (self.fsdp and self.fsdp_on_meta and self.init_from is None)
             or self.barter_options.get("init", "first") not in RANKED_INITS,
             f"init {self.barter_options.get('init')!r} ranks units by their weights, which a model built on the meta "
             "device does not have yet: with fsdp use init first or random, or --no-fsdp-on-meta"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)
        from ..baselines import baseline_options
        from ..rebuild import timm_with_models

        if self.method in BASELINE_METHODS:
            unknown = sorted(set(self.baseline_options) - set(baseline_options(self.method)))
            if unknown:
                raise ConfigError(f"baseline_options: {self.method} has no option(s) {', '.join(unknown)} "
                                  f"(it takes {', '.join(baseline_options(self.method))})")
        if self.model not in timm_with_models().list_models():
            raise ConfigError(f"unknown model {self.model!r} (not in timm's registry)")
        try:
            options = Options.from_kwargs(**self.barter_options)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"barter_options: {e}") from None
        self._check_calibration(options.init)

    def _check_calibration(self, init: str) -> None:
        """`calibration` is given exactly when a wrapped method keeps units by score."""
        scored = self.method in WRAP_METHODS and init == "score"
        if self.calibration is not None and self.calibration < 1:
            raise ConfigError(f"calibration must be >= 1 training batches, got {self.calibration}")
        if scored and self.calibration is None:
            raise ConfigError("barter_options init 'score' measures D on training batches: set calibration "
                              "(--calibration N)")
        if not scored and self.calibration is not None:
            raise ConfigError(f"calibration is read by barter_options init 'score' only (method {self.method}, "
                              f"init {init!r})")

    def to_dict(self) -> dict[str, Any]:
        """JSON-normal dictionary (tuples become lists), as config.json and checkpoints store it."""
        return json.loads(json.dumps(asdict(self)))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        """A config from a mapping of field values (text allowed, as `coerce_fields` reads it)."""
        return cls(**coerce_fields(data))

    def default_name(self) -> str:
        rho = "" if self.method == "dense" else f"-rho{self.density:g}"
        suffix = "-matched" if self.continue_from else ""
        return f"{self.preset}-{self.method}{rho}-seed{self.seed}{suffix}"


# one line per field for `barter train --help`; a field without one is still a flag (named after the field)
FIELD_HELP: dict[str, str] = {
    "preset": "named setup the other fields start from (barter.training.presets); custom: TrainConfig's defaults",
    "model": "a timm model name (the project's models are registered)",
    "model_kwargs": "extra keyword arguments of timm.create_model, e.g. '{num_heads: 4}'",
    "init_from": "dense run directory, checkpoint, or timm weights file to fine-tune (a new classifier only when "
                 "the class count differs). From it, min_heads is 1 unless barter_options set it or name a "
                 "transfer_policy: a transfer taking a block's only head measured 5 points below method static "
                 "there, keeping it level with static (README, 'From a trained model'); min_heads 0 warns",
    "dataset": "cifar100, tiny-imagenet, mnist5k, fake, or folder (DATA_DIR/train/<class>/*, DATA_DIR/val/<class>/*)",
    "data_dir": "where the data set lives",
    "img_size": "train at this image size (default: the data's)",
    "in_chans": "image channels (MNIST and fake data: 1 or 3)",
    "normalize_as": "use this data set's mean and std (fine-tuning keeps the source's)",
    "recipe": "augmentation recipe: cct, vit, light or none (default: the data set's)",
    "fake_size": "training images of the fake data set",
    "val_size": "training images held out to select the best checkpoint (0: the test split selects it)",
    "passes": "shuffled passes over the training set per epoch",
    "drop_last": "drop the last incomplete batch of an epoch",
    "batch_size": "global batch size",
    "workers": "data loader processes (default: one per spare CPU core, at most 8; in-memory sets need none)",
    "epochs": "training epochs",
    "lr": "peak learning rate (after warmup)",
    "min_lr": "learning rate at the end of the cosine",
    "warmup_epochs": "epochs of linear warmup",
    "weight_decay": "decoupled weight decay",
    "decay": "weight decay before (AdamW) or after the Adam update",
    "label_smoothing": "label smoothing of the cross-entropy",
    "method": "dense, a barter.wrap method, or a baseline",
    "density": "rho in (0, 1]: fraction of heads and channels kept",
    "barter_options": "barter.wrap options as a mapping (or the flags below)",
    "calibration": "training batches that measure D for --init score",
    "seed": "random seed of model, data order and method",
    "device": "auto (default), cpu, cuda, cuda:1, ...",
    "fsdp": "shard the model with FSDP2 under torchrun (after the wrap); sharded checkpoints",
    "fsdp_on_meta": "with fsdp: build and wrap on the meta device, each process writing only its shards (default)",
    "model_ema": "decay of an EMA of the weights that is evaluated, selects the best checkpoint and is exported",
    "flop_budget": "stop at this cumulative F_total (FLOPs), or at the final F_total of the run directory given",
    "continue_from": "finished run to continue with its topology fixed (matched compute)",
    "out_dir": "parent of run directories",
    "name": "run directory name (default: preset-method-rho-seed)",
    "progress": "per-epoch lines, and a progress bar when stderr is a terminal",
}


def field_types(cls: type = TrainConfig) -> dict[str, Any]:
    """{field name: its resolved type annotation} of the dataclass `cls`."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in fields(cls)}


def coerce_fields(data: dict[str, Any]) -> dict[str, Any]:
    """`data` as TrainConfig field values: unknown keys and values of the wrong type raise ConfigError."""
    types = field_types()
    unknown = sorted(set(data) - set(types))
    if unknown:
        raise ConfigError(f"unknown config field(s): {', '.join(unknown)}")
    try:
        values = {name: coerce(name, types[name], value) for name, value in data.items()}
    except FieldValueError as e:
        raise ConfigError(str(e)) from None
    if "barter_options" in values:
        values["barter_options"] = coerce_barter_options(values["barter_options"])
    return values


def coerce_barter_options(data: dict[str, Any]) -> dict[str, Any]:
    """`data` as `barter.wrap` options (`barter.options.Options` fields), checked like `coerce_fields`."""
    types = field_types(Options)
    unknown = sorted(set(data) - set(types))
    if unknown:
        raise ConfigError(f"barter_options: unknown option(s) {', '.join(unknown)}; known: {', '.join(types)}")
    try:
        return {name: coerce(f"barter_options.{name}", types[name], value) for name, value in data.items()}
    except FieldValueError as e:
        raise ConfigError(str(e)) from None


def read_run_config(run: str | Path) -> TrainConfig:
    """The config.json of the run directory `run`."""
    path = Path(run) / "config.json"
    if not Path(run).exists():
        raise ConfigError(f"{run} does not exist")
    if not path.is_file():
        raise ConfigError(f"{run} is not a run directory (no config.json)")
    try:
        data = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path} is damaged (not valid JSON: {e}); the checkpoints hold the run's config "
                          "under 'config' in trainer.pt") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} is damaged (a {type(data).__name__}, not a mapping of TrainConfig fields)")
    try:
        return TrainConfig.from_dict(data)
    except (ConfigError, TypeError) as e:
        raise ConfigError(f"{path} is damaged ({e})") from None


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The field values of a YAML or JSON config file (a mapping of TrainConfig fields), checked."""
    import yaml

    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read config file {path} ({e.strerror})") from None
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        raise ConfigError(f"{path} is not valid {'JSON' if path.suffix == '.json' else 'YAML'}: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping of TrainConfig fields, not {type(data).__name__}")
    try:
        return coerce_fields(data)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


# what a data set of its own (mnist5k, fake) sets that a folder tree reads from its files instead
FOLDER_READS = ("img_size", "in_chans", "normalize_as")


def infer_dataset(config: TrainConfig, given: Collection[str]) -> TrainConfig:
    """`config` with the image folder at `data_dir` as its data set when `data_dir` was `given` (a flag or the
    config file) but the data set, not given, reads no files (the default preset's MNIST), saying so on stderr;
    a data set given that reads no files, or a `data_dir` that is no folder tree, is refused. The preset's image
    size, channels and normalisation (`FOLDER_READS`) give way to the folder's own unless they were given too."""
    if "data_dir" not in given or config.dataset not in READS_NO_FILES:
        return config
    layout = f"{config.data_dir}/train/<class>/* and {config.data_dir}/val/<class>/*"
    if "dataset" in given:
        raise ConfigError(f"dataset {config.dataset} reads no files, so data_dir {config.data_dir} would be unused: "
                          f"pass --dataset folder for an image tree ({layout}), or leave out --data-dir")
    if not is_folder_tree(config.data_dir):
        raise ConfigError(f"data_dir {config.data_dir} has no train/ and val/ folders, and the preset's dataset "
                          f"{config.dataset} reads no files: lay out {layout} for --dataset folder, or pass "
                          "--dataset cifar100 or tiny-imagenet for those data sets' files")
    print(f"data_dir {config.data_dir} has train/ and val/: training on that image folder (--dataset folder) "
          f"instead of the preset's {config.dataset}", file=sys.stderr)
    return replace(config, dataset=FOLDER, **{name: None for name in FOLDER_READS if name not in given})
