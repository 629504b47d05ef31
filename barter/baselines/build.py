"""`build_sparse`: find the weights BARTER compacts and make them dynamically sparse (RigL or SET)."""
from __future__ import annotations

import copy

import torch
from torch import nn

from fxsurgery import Surgeon

from ..analysis import default_example_inputs
from .density import layer_counts
from .dynamic import DynamicSparse


def sparse_weight_names(model: nn.Module, example_inputs: tuple | None = None) -> list[str]:
    """The 2-D `.weight` parameters of the exact head and FFN-channel groups fxsurgery finds, in model order.

    These are each block's attention input/output projections and FFN fc1/fc2: the weights `barter.wrap`
    compacts. The analysis runs on a copy, so `model` keeps its own forward.
    """
    probe = copy.deepcopy(model)
    surgeon = Surgeon(probe, tuple(example_inputs or default_example_inputs(probe)))
    params = dict(model.named_parameters())
    names: list[str] = []
    for g in surgeon.groups:
        for s in g.slices if g.exact else ():
            if s.name.endswith(".weight") and params[s.name].dim() == 2 and s.name not in names:
                names.append(s.name)
    return names


def build_sparse(model: nn.Module, optimizer: torch.optim.Optimizer, *, method: str = "rigl", density: float = 0.5,
                 total_steps: int, seed: int = 0, distribution: str = "erk", update_interval: int = 100,
                 end_fraction: float = 0.75, drop_fraction: float = 0.3,
                 example_inputs: tuple | None = None) -> DynamicSparse:
    """Mask `model`'s projection weights to `density` (their kept fraction) and return the RigL/SET driver.

    Layer densities follow `distribution` ("erk" or "uniform"); initial masks are uniformly random with exactly
    each layer's count. See `barter.baselines.dynamic` for the optimizer protocol: call `sp.step()` right after
    every `optimizer.step()`. To resume, build again with the same arguments and call `sp.load_state_dict(sd)`.
    """
    if not 0 < density <= 1:
        raise ValueError(f"density must be in (0, 1], got {density}")
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    params = dict(model.named_parameters())
    weights = {n: params[n] for n in sparse_weight_names(model, example_inputs)}
    if not weights:
        raise ValueError("no attention or FFN projection weights found to sparsify")
    counts = layer_counts([tuple(w.shape) for w in weights.values()], density, distribution)
    return DynamicSparse(weights, dict(zip(weights, counts)), optimizer, method=method, total_steps=total_steps,
                         update_interval=update_interval, end_fraction=end_fraction, drop_fraction=drop_fraction,
                         generator=torch.Generator().manual_seed(seed))
