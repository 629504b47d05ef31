"""The weights an unstructured baseline sparsifies, with their per-layer active counts, checked as build_sparse does."""
from __future__ import annotations

import torch
from torch import nn

from barter.sparse.build import sparse_weight_names
from barter.sparse.density import layer_counts


def sparse_targets(model: nn.Module, *, density: float, total_steps: int, distribution: str,
                   example_inputs: tuple | None = None) -> tuple[dict[str, nn.Parameter], dict[str, int]]:
    """(weights by name, active count by name) of `model`'s projection weights at overall `density`."""
    if not 0 < density <= 1:
        raise ValueError(f"density must be in (0, 1], got {density}")
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    params = dict(model.named_parameters())
    weights = {n: params[n] for n in sparse_weight_names(model, example_inputs)}
    if not weights:
        raise ValueError("no attention or FFN projection weights found to sparsify")
    counts = layer_counts([tuple(w.shape) for w in weights.values()], density, distribution)
    return weights, dict(zip(weights, counts))


def check_optimized(optimizer: torch.optim.Optimizer, params: list[nn.Parameter]) -> None:
    """Raise ValueError unless every parameter in `params` is one `optimizer` steps."""
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    if any(id(p) not in stepped for p in params):
        raise ValueError("the optimizer does not step every sparsified parameter")
