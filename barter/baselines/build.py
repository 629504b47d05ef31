"""The weights the unstructured baselines sparsify (those BARTER compacts), and `build_sparse` for RigL / SET."""
from __future__ import annotations

import torch
from torch import nn

from fxsurgery import analyse

from ..analysis import default_example_inputs
from .density import layer_counts
from .dynamic import DynamicSparse


def sparse_weight_names(model: nn.Module, example_inputs: tuple | None = None) -> list[str]:
    """The 2-D `.weight` parameters of the exact head and FFN-channel groups fxsurgery finds, in model order.

    These are each block's attention input/output projections and FFN fc1/fc2: the weights `barter.wrap`
    compacts. The analysis leaves `model` untouched: it keeps its own forward.
    """
    analysis = analyse(model, tuple(example_inputs or default_example_inputs(model)))
    params = dict(model.named_parameters())
    names: list[str] = []
    for g in analysis.groups:
        for s in g.slices if g.exact else ():
            if s.name.endswith(".weight") and params[s.name].dim() == 2 and s.name not in names:
                names.append(s.name)
    return names


def sparse_targets(model: nn.Module, optimizer: torch.optim.Optimizer, *, density: float, total_steps: int,
                   distribution: str, example_inputs: tuple | None = None
                   ) -> tuple[dict[str, nn.Parameter], dict[str, int]]:
    """(weights by name, active count by name) of `model`'s projection weights at overall `density`.

    Raises ValueError for a density outside (0, 1], no steps, no projection weights, or an optimizer that does
    not step every one of them.
    """
    if not 0 < density <= 1:
        raise ValueError(f"density must be in (0, 1], got {density}")
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    params = dict(model.named_parameters())
    weights = {n: params[n] for n in sparse_weight_names(model, example_inputs)}
    if not weights:
        raise ValueError("no attention or FFN projection weights found to sparsify")
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    if any(id(w) not in stepped for w in weights.values()):
        raise ValueError("the optimizer does not step every sparsified parameter")
    counts = layer_counts([tuple(w.shape) for w in weights.values()], density, distribution)
    return weights, dict(zip(weights, counts))


def build_sparse(model: nn.Module, optimizer: torch.optim.Optimizer, *, method: str = "rigl", density: float = 0.5,
                 total_steps: int, seed: int = 0, distribution: str = "erk", update_interval: int = 100,
                 end_fraction: float = 0.75, drop_fraction: float = 0.3,
                 example_inputs: tuple | None = None) -> DynamicSparse:
    """Mask `model`'s projection weights to `density` (their kept fraction) and return the RigL/SET driver.

    Layer densities follow `distribution` ("erk" or "uniform"); initial masks are uniformly random with exactly
    each layer's count. See `barter.baselines.dynamic` for the optimizer protocol: call `sp.step()` right after
    every `optimizer.step()`. To resume, build again with the same arguments and call `sp.load_state_dict(sd)`.
    """
    weights, counts = sparse_targets(model, optimizer, density=density, total_steps=total_steps,
                                     distribution=distribution, example_inputs=example_inputs)
    return DynamicSparse(weights, counts, optimizer, method=method, total_steps=total_steps,
                         update_interval=update_interval, end_fraction=end_fraction, drop_fraction=drop_fraction,
                         generator=torch.Generator().manual_seed(seed))
