"""BARTER: compact transformer training that moves whole heads and FFN channels between layers.

`barter.wrap(model, ...)` shrinks a model in place to density rho and returns a `Controller` that collects
activation x gradient scores and runs the scheduled capacity transfers (see `barter.wrap.wrap`).
`barter.DistributedModel(model, ctl, ...)` is DistributedDataParallel that follows the transfers.
`barter.export(model, path)` writes a compact model as safetensors plus its topology; `barter.load(path)`
rebuilds it (see `barter.export`).
"""
from .controller import Controller
from .distributed import DistributedModel
from .export import ExportError, export, load
from .wrap import wrap

__all__ = ["Controller", "DistributedModel", "ExportError", "export", "load", "wrap"]
