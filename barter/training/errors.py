"""The errors a `barter` command reports as a usage error (exit status 2 and the message, no traceback): a config,
a checkpoint or run directory, or a data set that cannot be used. Apart from the modules that raise them, so that
the command catches them without importing torch."""
from __future__ import annotations

from .config import ConfigError


class CheckpointError(ValueError):
    """A checkpoint (or run log) that cannot be read, lacks what training needs, or was made by another
    configuration."""


class DatasetNotFoundError(FileNotFoundError):
    """A data set's files are not where they are expected; the message says what to put where."""


USER_ERRORS: tuple[type[Exception], ...] = (ConfigError, CheckpointError, DatasetNotFoundError)
