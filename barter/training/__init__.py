"""The paper's training pipeline around `barter.wrap`: configuration and presets, data and recipe, the epoch
loop with FLOP counting, checkpoints and evaluation, multi-process runs, and the `barter` command.

    result = train(preset("mnist5k_quick"))      # or: barter train --preset mnist5k_quick

Reading order: `config` (what a run depends on), `presets`, `session` (what it builds), `loop` (how it
trains), then `batches`, `checkpoint`, `evaluation`, `processes`, `runlog`, `data`, `recipe`, `flops`, `cli`.
"""
from .config import METHODS, ConfigError, TrainConfig
from .loop import RunResult, train
from .presets import PRESETS, preset

__all__ = ["METHODS", "PRESETS", "ConfigError", "RunResult", "TrainConfig", "preset", "train"]
