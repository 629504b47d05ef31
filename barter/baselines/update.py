"""One layer's mask update of RigL / SET: drop the smallest active magnitudes, grow the best-scored others."""
from __future__ import annotations

import math

import torch
from torch import Tensor


def cosine_drop_fraction(step: int, alpha: float, end_step: int) -> float:
    """alpha_t = alpha / 2 * (1 + cos(pi * t / T_end)), the drop fraction's cosine decay (RigL)."""
    return alpha / 2 * (1 + math.cos(math.pi * step / end_step))


def drop_and_grow(weight: Tensor, mask: Tensor, grow_score: Tensor, fraction: float) -> tuple[Tensor, Tensor]:
    """Return (new mask, new connections) for one layer; both boolean, shaped like `weight`.

    n_drop = floor(fraction * active). The n_active - n_drop active weights of largest |w| stay; n_drop positions
    of largest `grow_score` among the rest (inactive or just dropped, as in the official RigL code) are grown, so
    the active count is unchanged. New connections are grown positions that were inactive before: the caller
    zeroes their weights and optimizer moments; a just-dropped position grown again keeps its value.
    """
    active = mask.flatten()
    n_active = int(active.sum())
    n_drop = int(n_active * fraction)
    keep_score = weight.detach().abs().flatten().masked_fill(~active, -math.inf)
    kept = torch.zeros_like(active)
    kept[keep_score.topk(n_active - n_drop, sorted=False).indices] = True
    grown = torch.zeros_like(active)
    grown[grow_score.flatten().masked_fill(kept, -math.inf).topk(n_drop, sorted=False).indices] = True
    return (kept | grown).view_as(mask), (grown & ~active).view_as(mask)
