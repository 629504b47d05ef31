"""SRigL (Lasby et al. 2024): RigL under a constant fan-in (every output neuron of a layer keeps the same number
of active inputs) with dynamic neuron ablation, and the condensed forward such a layer allows.

    sp = build_srigl(model, optimizer, density=0.3, total_steps=T, seed=0)
    ... loss.backward(); optimizer.step(); sp.step()
    sp.ablated_fraction()   # {weight name: fraction of its output neurons ablated}
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from .build import sparse_targets
from .dynamic import DynamicSparse


class Condensed(NamedTuple):
    """A constant fan-in weight as `values[o, j]` = weight[o, index[o, j]] (ablated rows: zero values)."""

    values: Tensor
    index: Tensor


def condense(weight: Tensor, mask: Tensor) -> Condensed:
    """The condensed form of a 2-D `weight` whose `mask` keeps the same number k of inputs in every active row."""
    fan_in = mask.sum(1)
    k = int(fan_in.max()) if fan_in.numel() else 0
    if bool(((fan_in != k) & (fan_in != 0)).any()):
        raise ValueError(f"mask has no constant fan-in: rows keep {sorted(set(fan_in.tolist()))} inputs")
    index = mask.to(torch.int8).topk(k, dim=1, sorted=False).indices.sort(dim=1).values
    values = weight.gather(1, index) * mask.gather(1, index).to(weight.dtype)
    return Condensed(values, index)


def condensed_linear(x: Tensor, condensed: Condensed, bias: Tensor | None = None) -> Tensor:
    """y[..., o] = sum_j values[o, j] * x[..., index[o, j]] (+ bias): the masked linear layer, reading only k
    inputs per output."""
    gathered = x[..., condensed.index]  # (..., out, k)
    y = (gathered * condensed.values).sum(-1)
    return y if bias is None else y + bias


def constant_fan_in(rows: int, target: int, ablated: int) -> int:
    """Active inputs per remaining neuron: the layer's target count shared by its rows - ablated neurons."""
    fan_in = target // (rows - ablated)
    if fan_in == 0:
        raise ValueError(f"a constant fan-in of 0: {target} active weights cannot feed {rows - ablated} neurons; "
                         "raise the density")
    return fan_in


def neurons_to_ablate(magnitude: Tensor, grow_score: Tensor, active: Tensor, *, n_keep: int, n_grow: int,
                      target: int, gamma_sal: float) -> Tensor:
    """Boolean (rows,): neurons with fewer than max(1, int(gamma_sal * k)) salient weights (k the layer's
    constant fan-in before ablation). Salient: the n_keep largest active |w| and the n_grow largest grow scores
    of the layer. At least target // fan-in-dense neurons always stay (the threshold drops to the count of the
    neuron ranked there), so the fan-in never exceeds the dense fan-in."""
    rows, dense_fan_in = magnitude.shape
    salient = torch.zeros(magnitude.numel(), dtype=torch.bool, device=magnitude.device)
    salient[magnitude.flatten().masked_fill(~active.flatten(), -math.inf).topk(n_keep, sorted=False).indices] = True
    salient[grow_score.flatten().topk(n_grow, sorted=False).indices] = True
    per_neuron = salient.view(rows, dense_fan_in).sum(1)
    threshold = max(1, int(gamma_sal * (target // rows)))
    min_neurons = target // dense_fan_in
    if min_neurons >= rows:
        return torch.zeros(rows, dtype=torch.bool, device=magnitude.device)
    threshold = min(threshold, int(per_neuron.sort(descending=True).values[min_neurons]))
    return per_neuron < threshold


def constant_fan_in_update(weight: Tensor, mask: Tensor, grow_score: Tensor, fraction: float, *, target: int,
                           gamma_sal: float) -> tuple[Tensor, Tensor]:
    """Return (new mask, new connections) of one 2-D layer; both boolean, shaped like `weight`.

    As RigL, n_drop = floor(fraction * active) and the n_active - n_drop largest |w| are candidates to stay; then
    neurons are ablated (`neurons_to_ablate`, if gamma_sal > 0), every other neuron keeps at most k = target //
    (rows - ablated) of its candidates (largest |w| first) and grows back to exactly k inputs at the largest
    grow scores among its other positions.
    """
    rows = weight.shape[0]
    magnitude = weight.detach().abs()
    n_active = int(mask.sum())
    n_drop = int(n_active * fraction)
    ablate = torch.zeros(rows, dtype=torch.bool, device=weight.device)
    if gamma_sal > 0:
        ablate = neurons_to_ablate(magnitude, grow_score, mask, n_keep=n_active - n_drop, n_grow=n_drop,
                                   target=target, gamma_sal=gamma_sal)
    fan_in = constant_fan_in(rows, target, int(ablate.sum()))
    candidates = ~ablate[:, None] & mask
    keep_score = magnitude.masked_fill(~candidates, -math.inf).flatten()
    n_keep = min(n_active - n_drop, int(candidates.sum()))
    kept = torch.zeros(weight.numel(), dtype=torch.bool, device=weight.device)
    kept[keep_score.topk(n_keep, sorted=False).indices] = True
    kept = kept.view_as(mask)
    row_kept = top_per_row(magnitude.masked_fill(~kept, -math.inf), fan_in) & kept
    score = grow_score.masked_fill(row_kept, math.inf)
    new_mask = top_per_row(score, fan_in) & ~ablate[:, None]
    return new_mask, new_mask & ~mask


def top_per_row(score: Tensor, k: int) -> Tensor:
    """Boolean mask of the k largest scores of every row."""
    out = torch.zeros(score.shape, dtype=torch.bool, device=score.device)
    out.scatter_(1, score.topk(k, dim=1, sorted=False).indices, True)
    return out


class ConstantFanInSparse(DynamicSparse):
    """SRigL: the RigL driver (schedule, optimizer protocol, drop fraction) with constant fan-in masks and neuron
    ablation. `targets[name]` is the layer's active count at full width; `counts[name]` the current one,
    (rows - ablated) * fan-in, at most the target.

    Differences from the reference (calgaryml/condensed-sparsity, src/rigl_torch/rigl_constant_fan.py):
    * A neuron keeps at most k of its drop-surviving candidates by largest |w|; the reference keeps an
      arbitrary k of them (the first in a sort of the boolean mask).
    * Ablation is applied to every sparse weight; the reference exempts the network's last layer, which is not
      among the weights sparsified here (the classifier stays dense).
    * gamma_sal is a fraction of the sparse fan-in (the reference's default config,
      use_sparse_const_fan_in_for_ablation); the reference's ViT config sets 0.95, its default 0.3.
    * No 1e-5 noise, zero-init of grown weights, momentum and Adam moments of new connections zeroed (the
      reference resets only SGD momentum buffers), as in this project's RigL driver; no gradient accumulation
      before an update.
    """

    methods = ("srigl",)

    def __init__(self, weights: dict[str, nn.Parameter], targets: dict[str, int], optimizer: torch.optim.Optimizer,
                 *, total_steps: int, update_interval: int, end_fraction: float, drop_fraction: float,
                 gamma_sal: float, generator: torch.Generator) -> None:
        not_matrices = [n for n, w in weights.items() if w.dim() != 2]
        if not_matrices:
            raise ValueError(f"constant fan-in needs 2-D weights; these are not: {not_matrices}")
        if not 0 <= gamma_sal <= 1:
            raise ValueError(f"gamma_sal must be in [0, 1], got {gamma_sal}")
        self.targets = dict(targets)
        self.gamma_sal = gamma_sal
        super().__init__(weights, targets, optimizer, method="srigl", total_steps=total_steps,
                         update_interval=update_interval, end_fraction=end_fraction, drop_fraction=drop_fraction,
                         generator=generator)
        self.counts = {n: int(m.sum()) for n, m in self.masks.items()}

    def _random_mask(self, weight: Tensor, count: int) -> Tensor:
        """Uniformly random inputs, count // rows of them in every row (no neuron ablated)."""
        rows = weight.shape[0]
        keep = torch.rand(weight.shape, generator=self.generator).topk(constant_fan_in(rows, count, 0), dim=1).indices
        mask = torch.zeros(weight.shape, dtype=weight.dtype).scatter_(1, keep, 1)
        return mask.to(weight.device)

    @torch.no_grad()
    def _update(self, scores: dict[str, Tensor], fraction: float) -> None:
        for name, w in self.weights.items():
            self._set_mask(name, *constant_fan_in_update(w, self.masks[name].bool(), scores[name], fraction,
                                                         target=self.targets[name], gamma_sal=self.gamma_sal))

    def ablated_fraction(self) -> dict[str, float]:
        """The fraction of each layer's output neurons that are ablated (no active input)."""
        return {n: float((m.sum(1) == 0).float().mean()) for n, m in self.masks.items()}

    def summary(self) -> dict[str, Any]:
        """The overall density and each layer's fraction of ablated output neurons."""
        return {**super().summary(), "ablated_fraction": self.ablated_fraction()}

    def fan_in(self) -> dict[str, int]:
        """Each layer's constant fan-in (active inputs of every neuron that is not ablated)."""
        return {n: int(m.sum(1).max()) for n, m in self.masks.items()}

    def condensed(self, name: str) -> Condensed:
        """Layer `name`'s weight in condensed form, for `condensed_linear`."""
        return condense(self.weights[name].detach(), self.masks[name].bool())

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore a saved state into a `build_srigl` of a freshly built model with the same arguments."""
        super().load_state_dict(sd)
        self.counts = {n: int(m.sum()) for n, m in self.masks.items()}


def build_srigl(model: nn.Module, optimizer: torch.optim.Optimizer, *, density: float = 0.5, total_steps: int,
                seed: int = 0, distribution: str = "uniform", update_interval: int = 100, end_fraction: float = 0.75,
                drop_fraction: float = 0.3, gamma_sal: float = 0.3,
                example_inputs: tuple | None = None) -> ConstantFanInSparse:
    """Mask `model`'s projection weights to `density` with a constant fan-in per neuron and return the SRigL driver
    (the RigL protocol: call `sp.step()` right after every `optimizer.step()`). `gamma_sal` = 0 turns neuron
    ablation off. Layer densities follow `distribution` (the reference's uniform by default). To resume, build
    again with the same arguments and call `sp.load_state_dict(sd)`."""
    weights, targets = sparse_targets(model, optimizer, density=density, total_steps=total_steps,
                                      distribution=distribution, example_inputs=example_inputs)
    return ConstantFanInSparse(weights, targets, optimizer, total_steps=total_steps, update_interval=update_interval,
                               end_fraction=end_fraction, drop_fraction=drop_fraction, gamma_sal=gamma_sal,
                               generator=torch.Generator().manual_seed(seed))
