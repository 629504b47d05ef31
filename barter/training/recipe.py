"""The paper's training recipe: label-smoothed cross-entropy, Adam with explicit decoupled weight decay, and a
learning rate that warms up linearly and then follows a cosine (method page, "Training protocol")."""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from timm.loss import SoftTargetCrossEntropy
from torch import Tensor, nn

from ..compat import foreach_mul_
from .config import DECAYS


def build_criterion(label_smoothing: float, mixed: bool) -> Callable[[Tensor, Tensor], Tensor]:
    """Cross-entropy with label smoothing. With batch mixing the targets arrive as soft, already smoothed
    distributions (timm's Mixup smooths them), so the soft-target cross-entropy is used instead."""
    return SoftTargetCrossEntropy() if mixed else nn.CrossEntropyLoss(label_smoothing=label_smoothing)


def build_optimizer(params: Iterable[Tensor], *, lr: float, weight_decay: float, decay: str,
                    betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8) -> torch.optim.Optimizer:
    """Adam with decoupled weight decay p <- p * (1 - lr * wd) on every parameter, biases and norms included.

    decay="before": the decay shrinks the parameters, then Adam updates them (torch's AdamW; paper: ViT).
    decay="after": Adam updates, then the decay shrinks the updated parameters (paper: CCT).
    One parameter group, so every parameter is decayed alike.
    """
    if decay == "before":
        return torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    if decay == "after":
        return AdamDecayAfter(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    raise ValueError(f"decay must be one of {DECAYS}, got {decay!r}")


class AdamDecayAfter(torch.optim.Adam):
    """Adam followed by decoupled weight decay of the updated parameters (each group's "decay_after" rate).

    The decay runs as the optimizer's first post-step hook, so hooks registered later (BARTER's controller)
    see the fully updated parameters. Overriding `step` instead would run step hooks twice whenever torch has
    patched `Adam.step` as well.
    """

    def __init__(self, params: Iterable[Tensor], *, lr: float, weight_decay: float,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=0.0)
        for group in self.param_groups:
            group["decay_after"] = weight_decay
        self.register_step_post_hook(_decay_after)


def _decay_after(optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
    """p <- p * (1 - lr * wd) for the parameters Adam just updated (those with a gradient)."""
    with torch.no_grad():
        for group in optimizer.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if params and group["decay_after"]:
                foreach_mul_(params, 1.0 - group["lr"] * group["decay_after"])


@dataclass(frozen=True)
class WarmupCosine:
    """Learning rate of optimizer step `start + k` (k = 0, 1, ...): linear warmup to `base_lr` over
    `warmup_steps` steps, then a cosine from `base_lr` down to `min_lr` at k = `total_steps`.

    `start` lets a continuation restart the schedule at a later global step (matched compute).
    """

    base_lr: float
    min_lr: float
    warmup_steps: int
    total_steps: int
    start: int = 0

    def lr(self, step: int) -> float:
        """The learning rate of global optimizer step `step` (0-based)."""
        k = step - self.start
        if k < self.warmup_steps:
            return self.base_lr * (k + 1) / self.warmup_steps
        progress = min(1.0, (k - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps))
        return self.min_lr + 0.5 * (self.base_lr - self.min_lr) * (1.0 + math.cos(math.pi * progress))

    def apply(self, optimizer: torch.optim.Optimizer, step: int) -> float:
        """Set every group's learning rate for global step `step`; returns it."""
        lr = self.lr(step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        return lr
