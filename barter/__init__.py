"""BARTER: compact transformer training that moves whole heads and FFN channels between layers.

`barter.wrap(model, ...)` shrinks a model in place to density rho and returns a `Controller` that collects
activation x gradient scores and runs the scheduled capacity transfers (see `barter.wrapping`).
`barter.DistributedModel(model, ctl, ...)` is DistributedDataParallel that follows the transfers (`barter.ddp`).
`barter.export(model, path)` writes a compact model as safetensors plus its topology; `barter.load(path)`
rebuilds it (see `barter.serialization`).

The method is this package's top level; `barter.training` is the paper's training pipeline and the `barter`
command, `barter.baselines` the dense-mask methods it compares against. The names below are imported on first
use (`barter.lazy`): the `barter` command answers `--help` without importing torch.
"""
from typing import TYPE_CHECKING

from .lazy import lazy_names

if TYPE_CHECKING:
    from .controller import Controller
    from .ddp import DistributedModel
    from .serialization import ExportError, export, load
    from .wrapping import wrap

__all__ = ["Controller", "DistributedModel", "ExportError", "export", "load", "wrap"]
__getattr__, __dir__ = lazy_names(__name__, {
    "Controller": "controller", "DistributedModel": "ddp", "ExportError": "serialization", "export": "serialization",
    "load": "serialization", "wrap": "wrapping",
})
