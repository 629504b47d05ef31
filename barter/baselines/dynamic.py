"""Masked dynamic sparse training (RigL, SET) of a chosen set of weights, driven by optimizer hooks.

Protocol (`barter.baselines.scheduled`): `build_sparse` registers a pre-step hook on the optimizer; the trainer
calls `sp.step()` right after every `optimizer.step()`.

* Ordinary step: the pre-step hook multiplies the sparse weights' gradients by their masks (the optimizer sees
  the gradient of the masked weight, as in the official implementations, so inactive moments stay zero);
  `sp.step()` then multiplies the weights by their masks.
* Mask-update step (t % update_interval == 0 and t < end_step, t the 1-based step): the mask update replaces
  the optimizer step. The pre-step hook keeps the dense gradients of the sparse weights (RigL's growth score)
  and sets every gradient of the optimizer to None, so `optimizer.step()` changes no weight, moment or step
  counter (torch optimizers skip parameters without a gradient); `sp.step()` then drops and grows. Anything
  the trainer does to the weights outside `optimizer.step()` (explicit weight decay, say) should be skipped
  when `sp.is_update_step(sp.step_count + 1)` is true before the step.

Gradient clipping before `optimizer.step()` sees the dense gradients.

Schedule as in the RigL paper's Algorithm 1 with 1-based steps t: updates at t = k * update_interval < end_step,
drop fraction alpha/2 * (1 + cos(pi t / end_step)). The official TensorFlow code counts from 0 (its first update
falls on the very first batch) and adds 1e-5 noise to the drop scores; both change single steps or ties only.
Its SET also takes the optimizer step on update steps; here the update replaces it for both methods alike.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from ..compat import foreach_mul_
from .scheduled import SparseTraining
from .update import cosine_drop_fraction, drop_and_grow


class DynamicSparse(SparseTraining):
    """Masks of the sparse weights, the update schedule, and the drop/grow rule of `method` ("rigl" or "set").

    `masks[name]` is a float tensor (1 active, 0 inactive) shaped like the weight; `counts[name]` its active
    count, constant through training. A subclass that changes the drop/grow rule names its own `methods`.
    """

    methods: tuple[str, ...] = ("rigl", "set")  # the values of `method` this driver implements

    def __init__(self, weights: dict[str, nn.Parameter], counts: dict[str, int], optimizer: torch.optim.Optimizer,
                 *, method: str, total_steps: int, update_interval: int, end_fraction: float, drop_fraction: float,
                 generator: torch.Generator) -> None:
        if method not in self.methods:
            raise ValueError(f"unknown method {method!r} for {type(self).__name__}; expected one of {self.methods}")
        super().__init__(optimizer, update_interval=update_interval, end_step=int(end_fraction * total_steps),
                         generator=generator)
        self.method = method
        self.weights = weights
        self.counts = counts
        self.alpha = drop_fraction
        self.masks = {name: self._random_mask(w, counts[name]) for name, w in weights.items()}
        self.apply_masks()

    def _random_mask(self, weight: Tensor, count: int) -> Tensor:
        """A uniformly random mask with exactly `count` active positions."""
        keep = torch.rand(weight.numel(), generator=self.generator).topk(count, sorted=False).indices
        mask = torch.zeros(weight.numel(), dtype=weight.dtype)
        mask[keep] = 1
        return mask.view_as(weight).to(weight.device)

    def drop_fraction(self, step: int) -> float:
        """The fraction of each layer's active weights dropped at update step `step` (cosine decay)."""
        return cosine_drop_fraction(step, self.alpha, self.end_step)

    @property
    def density(self) -> float:
        """Active fraction of the sparse weights."""
        return sum(self.counts.values()) / sum(w.numel() for w in self.weights.values())

    def summary(self) -> dict[str, Any]:
        """What a training run logs of the driver each epoch: the active fraction of the sparse weights."""
        return {"density": self.density}

    @torch.no_grad()
    def apply_masks(self) -> None:
        """Zero the inactive weights."""
        foreach_mul_(list(self.weights.values()), list(self.masks.values()))

    def _mask_gradients(self) -> None:
        pairs = [(w.grad, self.masks[n]) for n, w in self.weights.items() if w.grad is not None]
        if pairs:
            foreach_mul_(*map(list, zip(*pairs)))

    def _scores(self) -> dict[str, Tensor]:
        """Growth scores: |dense gradient| (RigL) or uniform random numbers (SET)."""
        if self.method == "set":
            return {n: torch.rand(w.shape, generator=self.generator).to(w.device) for n, w in self.weights.items()}
        missing = [n for n, w in self.weights.items() if w.grad is None]
        if missing:
            raise RuntimeError(f"RigL grows by gradient, but these weights have none at an update step: {missing}")
        return {n: w.grad.abs() for n, w in self.weights.items()}

    @torch.no_grad()
    def _update(self, scores: dict[str, Tensor], fraction: float) -> None:
        """Drop and grow in every layer; new connections get zero weights and zero optimizer moments."""
        for name, w in self.weights.items():
            self._set_mask(name, *drop_and_grow(w, self.masks[name].bool(), scores[name], fraction))

    def _set_mask(self, name: str, mask: Tensor, new: Tensor) -> None:
        """A layer's new mask; its new connections get zero weights and zero optimizer moments."""
        w = self.weights[name]
        self.masks[name] = mask.to(w.dtype)
        self.counts[name] = int(mask.sum())
        w.masked_fill_(new, 0)
        for value in self.optimizer.state.get(w, {}).values():
            if isinstance(value, Tensor) and value.shape == w.shape:  # exp_avg(_sq), momentum_buffer, ...
                value.masked_fill_(new, 0)

    def state_dict(self) -> dict[str, Any]:
        """Method, step count, boolean masks and RNG state."""
        return {"method": self.method, "step": self.step_count, "rng": self.generator.get_state(),
                "masks": {n: m.bool().cpu() for n, m in self.masks.items()}}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore a saved state into a `build_sparse` of a freshly built model with the same arguments."""
        if sd["method"] != self.method or set(sd["masks"]) != set(self.masks):
            raise ValueError("state_dict comes from another method or another set of sparse weights")
        for name, w in self.weights.items():
            self.masks[name] = sd["masks"][name].to(device=w.device, dtype=w.dtype)
        self.step_count = sd["step"]
        self.generator.set_state(sd["rng"])
        self.apply_masks()
