"""The private Lightning API barter's Lightning integration relies on, reached from here only (as
``barter.compat`` does for torch's): ``tests/test_compat.py`` exercises each entry on the installed Lightning and
fails on a private Lightning name reached anywhere else. Importing this module imports Lightning."""
from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher

# each private name as the check spells it -> the name of this module that reaches it
PRIVATE_LIGHTNING_NAMES: dict[str, str] = {
    "lightning.pytorch.strategies.launchers._MultiProcessingLauncher": "fits_in_child_processes",
}


def fits_in_child_processes(trainer: pl.Trainer) -> bool:
    """Whether the trainer's strategy fits in processes it spawns or forks (``ddp_spawn``, ``ddp_fork``,
    ``ddp_notebook``), not in the launching one: its launcher is a ``_MultiProcessingLauncher`` (Lightning >= 2.0)."""
    return isinstance(trainer.strategy.launcher, _MultiProcessingLauncher)
