"""What a training run depends on: `TrainConfig`, its checks, and the methods it can train.

Methods: "dense" (no wrap at all), the methods of `barter.wrap` ("static", "barter" and the random ablations),
and the baselines of `barter.baselines` ("rigl", "set", "snfs", "srigl", "s2vite"). A bad value raises
`ConfigError` naming the field.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import timm

import models  # noqa: F401  (registers the project's models with timm)

from ..baselines import METHODS as BASELINE_METHODS
from ..baselines import baseline_options
from ..selection import METHODS as WRAP_METHODS
from .data import DATASETS, RECIPES
from .precision import AMP_MODES
from .recipe import DECAYS

METHODS = ("dense", *WRAP_METHODS, *BASELINE_METHODS)


class ConfigError(ValueError):
    """A configuration that cannot be trained; the message names the field and the reason."""


@dataclass
class TrainConfig:
    """Everything a run depends on. Presets (`barter.training.presets`) fill it; the CLI overrides single fields.

    Data: `val_size` training images (a fixed split) are held out to select the best checkpoint; with 0 the
    test split selects it. An epoch is `passes` shuffled passes; `drop_last` drops the final incomplete batch
    (an odd one is always dropped when batches are mixed). Method: `barter_options` go to `barter.wrap`,
    `baseline_options` to the baseline's factory (`barter.baselines.baseline_options(method)` lists them).
    Optimisation: see `barter.training.recipe`; `decay` is "after" (CCT) or "before" (ViT). Compute:
    `flop_budget` stops at that cumulative F_total (a final partial epoch allowed); `continue_from` continues a
    finished run's endpoint up to `flop_budget` (matched compute). `amp`: "fp32" (the paper's), "bf16" autocast,
    or "fp16" autocast with loss scaling (`barter.training.precision`).
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
    baseline_options: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    device: str = "auto"
    amp: str = "fp32"
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
            (self.continue_from is None or self.method not in BASELINE_METHODS,
             f"continue_from fixes a BARTER topology; it does not apply to {self.method}"),
            (not self.baseline_options or self.method in BASELINE_METHODS,
             f"baseline_options apply to the baselines ({', '.join(BASELINE_METHODS)}), not to {self.method}"),
            (self.workers >= 0, f"workers must be >= 0, got {self.workers}"),
            (self.amp in AMP_MODES, f"amp must be one of {', '.join(AMP_MODES)}, got {self.amp!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)
        if self.method in BASELINE_METHODS:
            unknown = sorted(set(self.baseline_options) - set(baseline_options(self.method)))
            if unknown:
                raise ConfigError(f"baseline_options: {self.method} has no option(s) {', '.join(unknown)} "
                                  f"(it takes {', '.join(baseline_options(self.method))})")
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
