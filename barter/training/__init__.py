"""The paper's training pipeline around `barter.wrap`: configuration and presets, data and recipe, the epoch
loop with FLOP counting, checkpoints and evaluation, multi-process runs, and the `barter` command.

    result = train(preset("mnist5k_quick"))      # or: barter train --preset mnist5k_quick

Reading order: `config` (what a run depends on), `presets`, `session` (what it builds), `loop` (how it
trains), then `batches`, `checkpoint`, `evaluation`, `processes`, `runlog`, `data`, `recipe`, `flops`, `cli`.
`train` and `RunResult` are imported on first use (`barter.lazy`): the config, the presets and the `barter`
command's parser import no torch.
"""
from typing import TYPE_CHECKING

from ..lazy import lazy_names
from .config import METHODS, ConfigError, TrainConfig
from .presets import PRESETS, preset

if TYPE_CHECKING:
    from .loop import RunResult, train

__all__ = ["METHODS", "PRESETS", "ConfigError", "RunResult", "TrainConfig", "preset", "train"]
__getattr__, __dir__ = lazy_names(__name__, {"RunResult": "loop", "train": "loop"})
