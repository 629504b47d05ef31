"""Sparse momentum (SNFS, Dettmers & Zettlemoyer 2019): prune by magnitude, regrow where the momentum is largest,
spreading the regrowth over layers by the mean momentum magnitude of their active weights.

    sp = build_snfs(model, optimizer, density=0.3, total_steps=T, seed=0)
    ... loss.backward(); optimizer.step(); sp.step()
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from .build import sparse_targets
from .dynamic import DynamicSparse

ADAM_EPS = 1e-8  # the reference's eps in exp_avg / (sqrt(exp_avg_sq) + eps)


def cosine_prune_rate(step: int, rate: float, min_rate: float, end_step: int) -> float:
    """min + (rate - min) / 2 * (1 + cos(pi t / T_end)): the reference's CosineDecay (CosineAnnealingLR)."""
    return min_rate + (rate - min_rate) / 2 * (1 + math.cos(math.pi * min(step, end_step) / end_step))


def optimizer_momentum(optimizer: torch.optim.Optimizer, weight: Tensor) -> Tensor:
    """The momentum SNFS reads: SGD's momentum_buffer, or Adam's exp_avg / (sqrt(exp_avg_sq) + eps)."""
    state = optimizer.state.get(weight, {})
    if state.get("exp_avg") is not None and state.get("exp_avg_sq") is not None:
        return state["exp_avg"] / (state["exp_avg_sq"].sqrt() + ADAM_EPS)
    if state.get("momentum_buffer") is not None:
        return state["momentum_buffer"]
    raise RuntimeError("SNFS grows by momentum, but the optimizer holds none for a sparse weight (an SGD without "
                       "momentum, or no optimizer step taken yet)")


def check_has_momentum(optimizer: torch.optim.Optimizer, params: list[nn.Parameter]) -> None:
    """Raise ValueError unless every group holding one of `params` keeps a momentum (Adam betas or SGD momentum)."""
    ids = {id(p) for p in params}
    for group in optimizer.param_groups:
        if any(id(p) in ids for p in group["params"]) and "betas" not in group and not group.get("momentum", 0):
            raise ValueError(f"SNFS needs an optimizer with momentum (SGD momentum > 0, or Adam/AdamW); "
                             f"{type(optimizer).__name__} has none for the sparse weights")


def redistribute(shares: list[float], total: int, capacities: list[int]) -> list[int]:
    """Split `total` into integers proportional to `shares`, none above its capacity (water-filling, then largest
    remainder); the parts sum to min(total, sum of capacities)."""
    total = min(total, sum(capacities))
    ideal = [0.0] * len(shares)
    open_ = [i for i, c in enumerate(capacities) if c > 0]
    left = float(total)
    while left > 1e-9 and open_:
        weight = sum(shares[i] for i in open_)
        portion = {i: left * (shares[i] / weight if weight > 0 else 1 / len(open_)) for i in open_}
        left = 0.0
        for i in open_:
            ideal[i] += portion[i]
            if ideal[i] > capacities[i]:
                left += ideal[i] - capacities[i]
                ideal[i] = float(capacities[i])
        open_ = [i for i in open_ if ideal[i] < capacities[i]]
    parts = [min(capacities[i], math.floor(x + 1e-9)) for i, x in enumerate(ideal)]
    for i in sorted(range(len(parts)), key=lambda i: (parts[i] - ideal[i], i)):
        if sum(parts) >= total:
            break
        if parts[i] < capacities[i]:
            parts[i] += 1
    return parts


class SparseMomentum(DynamicSparse):
    """SNFS on masked unstructured weights; the optimizer protocol of `DynamicSparse` except as listed below.

    Per update: prune rate p_t by cosine decay from `prune_rate` to `min_prune_rate`; each layer l drops its
    ceil(p_l * n_l) smallest |w| (p_l = p_t, lowered to the layer's sparsity when the layer is over 80% dense and
    its momentum share above average, as the reference's adjust_prune_rate); the dropped total is regrown across
    layers in proportion to the mean |momentum| of each layer's active weights (before the prune), and within a
    layer at the largest |momentum| among its inactive positions (the just-dropped included). Gradients are not
    masked: the momentum of inactive weights is the growth signal, so it must see the dense gradient.

    Differences from the reference (TimDettmers/sparse_learning, sparselearning/core.py and funcs.py):
    * Updates every `update_interval` steps (t % interval == 0, t < end_step) instead of at each epoch's end; the
      prune-rate cosine runs over end_step (the reference's T_max is all training steps: end_fraction=1.0).
    * The regrowth is split exactly (water-filling under each layer's free capacity, largest remainder): the total
      active count never changes, so the reference's smoothed growth adjustment for rounding is not needed; a
      layer may fill up completely (the reference stops at 99% of its free capacity).
    * The initial masks hold each layer's exact count (the reference draws Bernoulli(density) per weight).
    * New connections (grown where inactive before) get zero momentum / Adam moments as well as zero weights, as
      the RigL driver does; the reference keeps their accumulated momentum.
    * The optimizer step is taken on update steps too (as in the reference), then the masks update in `step()`.
    """

    methods = ("snfs",)

    def __init__(self, weights: dict[str, nn.Parameter], counts: dict[str, int], optimizer: torch.optim.Optimizer,
                 *, total_steps: int, update_interval: int, end_fraction: float, prune_rate: float,
                 min_prune_rate: float, generator: torch.Generator) -> None:
        if not 0 <= min_prune_rate <= prune_rate <= 1:
            raise ValueError(f"need 0 <= min_prune_rate <= prune_rate <= 1, got {min_prune_rate}, {prune_rate}")
        check_has_momentum(optimizer, list(weights.values()))
        super().__init__(weights, counts, optimizer, method="snfs", total_steps=total_steps,
                         update_interval=update_interval, end_fraction=end_fraction, drop_fraction=prune_rate,
                         generator=generator)
        self.min_prune_rate = min_prune_rate
        self.counts = dict(counts)  # per-layer counts move with the redistribution; their sum does not

    def prune_rate(self, step: int) -> float:
        """The prune rate at update step `step`."""
        return cosine_prune_rate(step, self.alpha, self.min_prune_rate, self.end_step)

    def drop_fraction(self, step: int) -> float:
        return self.prune_rate(step)

    def summary(self) -> dict[str, Any]:
        """The overall density and each layer's, which the momentum redistribution moves."""
        return {**super().summary(),
                "layer_density": {n: self.counts[n] / w.numel() for n, w in self.weights.items()}}

    def _before_optimizer_step(self, optimizer: torch.optim.Optimizer, *, update: bool) -> None:
        """Nothing: the optimizer sees the dense gradients and steps on update steps too."""

    @torch.no_grad()
    def _update(self, scores: None, rate: float) -> None:
        """Prune by magnitude at `rate`, regrow by momentum (the pre-step hook takes no scores)."""
        names = list(self.weights)
        momenta = {n: optimizer_momentum(self.optimizer, self.weights[n]).abs() for n in names}
        shares = momentum_shares({n: momenta[n][self.masks[n].bool()] for n in names})
        kept = {n: self._pruned(n, self._layer_rate(n, rate, shares[n], len(names))) for n in names}
        removed = sum(self.counts[n] - int(kept[n].sum()) for n in names)
        grow = redistribute([shares[n] for n in names], removed,
                            [self.weights[n].numel() - int(kept[n].sum()) for n in names])
        for name, n_grow in zip(names, grow):
            before = self.masks[name].bool()
            score = momenta[name].flatten().masked_fill(kept[name].flatten(), -math.inf)
            grown = torch.zeros_like(before).flatten()
            grown[score.topk(n_grow, sorted=False).indices] = True
            grown = grown.view_as(before)
            self._set_mask(name, kept[name] | grown, grown & ~before)

    def _layer_rate(self, name: str, rate: float, share: float, layers: int) -> float:
        """The reference's adjust_prune_rate: a layer over 80% dense that draws more than its even share of the
        regrowth prunes at most its sparsity."""
        sparsity = 1 - self.counts[name] / self.weights[name].numel()
        return min(rate, sparsity) if sparsity < 0.2 and share > 1 / layers else rate

    def _pruned(self, name: str, rate: float) -> Tensor:
        """The boolean mask of layer `name` with its ceil(rate * n) smallest active |w| dropped."""
        w, active = self.weights[name], self.masks[name].bool()
        n_keep = self.counts[name] - min(self.counts[name], math.ceil(rate * self.counts[name]))
        score = w.detach().abs().flatten().masked_fill(~active.flatten(), -math.inf)
        kept = torch.zeros_like(active).flatten()
        kept[score.topk(n_keep, sorted=False).indices] = True
        return kept.view_as(active)

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore a saved state into a `build_snfs` of a freshly built model with the same arguments."""
        super().load_state_dict(sd)
        self.counts = {n: int(m.sum()) for n, m in self.masks.items()}


def momentum_shares(active_momenta: dict[str, Tensor]) -> dict[str, float]:
    """Each layer's mean |momentum| over its active weights, normalised to sum 1 (even shares if all are zero)."""
    means = {n: float(m.mean()) if m.numel() else 0.0 for n, m in active_momenta.items()}
    total = sum(means.values())
    return {n: v / total if total > 0 else 1 / len(means) for n, v in means.items()}


def build_snfs(model: nn.Module, optimizer: torch.optim.Optimizer, *, density: float = 0.5, total_steps: int,
               seed: int = 0, distribution: str = "uniform", update_interval: int = 100, end_fraction: float = 1.0,
               prune_rate: float = 0.5, min_prune_rate: float = 0.005,
               example_inputs: tuple | None = None) -> SparseMomentum:
    """Mask `model`'s projection weights to `density` and return the SNFS driver (call `sp.step()` right after
    every `optimizer.step()`; the optimizer needs momentum). Layer densities start from `distribution` (the
    paper's uniform by default) and then move with the momentum redistribution. To resume, build again with the
    same arguments and call `sp.load_state_dict(sd)`."""
    weights, counts = sparse_targets(model, optimizer, density=density, total_steps=total_steps,
                                     distribution=distribution, example_inputs=example_inputs)
    return SparseMomentum(weights, counts, optimizer, total_steps=total_steps, update_interval=update_interval,
                          end_fraction=end_fraction, prune_rate=prune_rate, min_prune_rate=min_prune_rate,
                          generator=torch.Generator().manual_seed(seed))
