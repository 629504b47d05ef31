"""BARTER: compact transformer training that moves whole heads and FFN channels between layers.

`barter.wrap(model, ...)` shrinks a model in place to density rho and returns a `Controller` that collects
activation x gradient scores and runs the scheduled capacity transfers (see `barter.wrap.wrap`).
"""
from .controller import Controller
from .wrap import wrap

__all__ = ["Controller", "wrap"]
