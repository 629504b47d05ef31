"""The baselines by name: `build_baseline(method, model, optimizer, ...)` gives a driver, a
`barter.method.TrainingMethod` (the mask-based ones are `SparseTraining`).

    sp = build_baseline("srigl", model, optimizer, density=0.3, total_steps=T, seed=0)
    ... loss.backward(); optimizer.step(); sp.step()
"""
from __future__ import annotations

import inspect
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn

from ..method import TrainingMethod
from ..method_names import Family, named
from .build import build_sparse
from .s2vite import build_s2vite
from .snfs import build_snfs
from .srigl import build_srigl

BUILDERS: dict[str, Callable[..., TrainingMethod]] = {
    "rigl": partial(build_sparse, method="rigl"),
    "set": partial(build_sparse, method="set"),
    "snfs": build_snfs,
    "srigl": build_srigl,
    "s2vite": build_s2vite,
}
COMMON_ARGUMENTS = ("model", "optimizer", "method", "density", "total_steps", "seed", "example_inputs")


def baseline_options(method: str) -> tuple[str, ...]:
    """The keyword options of `method`'s factory beyond the arguments every baseline takes."""
    if method not in BUILDERS:
        raise ValueError(f"unknown baseline {method!r}; expected one of {named(Family.BASELINE)}")
    return tuple(n for n in inspect.signature(BUILDERS[method]).parameters if n not in COMMON_ARGUMENTS)


def build_baseline(method: str, model: nn.Module, optimizer: torch.optim.Optimizer, *, density: float,
                   total_steps: int, seed: int = 0, example_inputs: tuple | None = None,
                   **options: Any) -> TrainingMethod:
    """Make `model` sparse to `density` under baseline `method` and return its driver; `options` go to the
    method's factory (`baseline_options(method)` lists them)."""
    unknown = sorted(set(options) - set(baseline_options(method)))
    if unknown:
        raise ValueError(f"{method} has no option(s) {', '.join(unknown)}; it takes {baseline_options(method)}")
    return BUILDERS[method](model, optimizer, density=density, total_steps=total_steps, seed=seed,
                            example_inputs=example_inputs, **options)
