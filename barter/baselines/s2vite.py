"""S²ViTE (Chen et al. 2021, structured): attention heads and FFN channels explored under unit masks, each
layer keeping a fixed number of live units; dead units are removed for good by `export_compact`.

    sp = build_s2vite(model, optimizer, density=0.5, total_steps=T, seed=0)
    ... loss.backward(); optimizer.step(); sp.step()
    compact = sp.export_compact()
"""
from __future__ import annotations

import copy
import math
from typing import Any

import torch
from torch import Tensor, nn

from fxsurgery import GroupDescription, Surgeon, UnitKind, analyse

from ..analysis import default_example_inputs
from ..compat import foreach_mul_
from .scheduled import SparseTraining
from .snfs import cosine_prune_rate


def unit_reduce(group: GroupDescription, tensors: dict[str, Tensor], fn: Any) -> Tensor:
    """Sum over the group's slices of fn(slice view with the unit axis moved first).flatten(1).sum(1): (count,)."""
    total = torch.zeros(group.count, dtype=torch.float64)
    for sl in group.slices:
        units = sl.units(tensors[sl.name], group.count).movedim(sl.dim + 1, 0).flatten(1)
        total += fn(units, sl).double().sum(1).cpu()
    return total


class StructuredSparse(SparseTraining):
    """Unit masks over fxsurgery's exact head and channel groups, with S²ViTE's prune-and-grow of units.

    A dead unit's output slices (the output projection's columns, `ParamSlice.output`) are zero, which removes
    its contribution exactly (what `Surgeon.remove` does physically); their gradients are masked on ordinary
    steps and the weights re-zeroed after every step. Its input-side slices keep their values: they receive no
    gradient while the unit is dead, and their activations make the dense gradient of the dead output columns
    the regrowth signal. Update steps follow the RigL driver (`barter.baselines.dynamic`): the update replaces the
    optimizer step (the pre-step hook records the scores and clears every gradient). Per update, each group
    drops ceil(rate * live) live units of lowest importance and revives as many of highest |gradient| among
    the dead (the just-dropped included); revived output columns start at zero with zero optimizer moments.
    Importance: heads by first-order Taylor |sum(grad * w)| over their output columns (equal to the reference's
    |grad . activation| of the head output), channels by the L1 norm of their weights. Rate: the reference's
    cosine decay from `death_rate` to 0.005 over all training steps; updates every `update_interval` steps
    before end_fraction (the reference's t_end) of training.

    Differences from the reference (VITA-Group/SViTE, SViTE/dst_utils/core.py, pruning_type "structure_new",
    and the Attention score hooks in SViTE/vision_transformer.py):
    * Units come from fxsurgery's groups (any architecture), not from `attn.qkv` / `mlp.fc1` names; the
      reference masks a dead head's qkv rows and a dead channel's fc1 row and fc2 column, here only the output
      columns are masked (same function, exact removal; the input side carries the growth signal).
    * The head Taylor score sums grad * activation over the batch before the absolute value (the reference
      averages per-image absolute values); head growth reads the gradient of the head's output columns rather
      than of its output activation (zero there once the columns are masked).
    * Channel L1 norms and gradient norms run over all the unit's slices (biases and any other sliced tensor);
      the reference uses the fc1 row and fc2 column weights.
    * Update steps replace the optimizer step (the reference takes it, then updates); moments of dead and
      revived units' output columns are zeroed (the reference zeroes SGD momentum only).

    Training FLOPs (`barter.training.flops`) are those of the executed masked full-width model, as for the
    unstructured baselines: the meter counts the shapes that run, and dead units still run under their masks.
    The compact cost of the live units is what `export_compact` gives (its parameter count is in the run's
    metrics).
    """

    def __init__(self, model: nn.Module, groups: list[GroupDescription], optimizer: torch.optim.Optimizer, *,
                 live: dict[str, int], total_steps: int, update_interval: int, end_fraction: float,
                 death_rate: float, min_death_rate: float, generator: torch.Generator) -> None:
        super().__init__(optimizer, update_interval=update_interval, end_step=int(end_fraction * total_steps),
                         generator=generator)
        self.model = model
        self.groups = {g.name: g for g in groups}
        self.tensors = dict(model.named_parameters())
        self.live = dict(live)
        self.total_steps = total_steps
        self.death_rate = death_rate
        self.min_death_rate = min_death_rate
        self.unit_masks = {name: self._random_units(g.count, live[name]) for name, g in self.groups.items()}
        self._refresh_masks()
        self.apply_masks()

    def _random_units(self, count: int, live: int) -> Tensor:
        mask = torch.zeros(count, dtype=torch.bool)
        mask[torch.rand(count, generator=self.generator).topk(live, sorted=False).indices] = True
        return mask

    def _refresh_masks(self) -> None:
        """Element masks of the output slices' tensors from the unit masks."""
        self.masks: dict[str, Tensor] = {}
        for name, g in self.groups.items():
            for sl in g.slices:
                if not sl.output:
                    continue
                t = self.tensors[sl.name]
                mask = self.masks.get(sl.name, torch.ones_like(t, requires_grad=False))
                view = sl.units(mask, g.count)
                for i in (~self.unit_masks[name]).nonzero().flatten().tolist():
                    view.select(sl.dim + 1, i).zero_()
                self.masks[sl.name] = mask

    def drop_fraction(self, step: int) -> float:
        """The fraction of each group's live units dropped at update step `step`."""
        return cosine_prune_rate(step, self.death_rate, self.min_death_rate, self.total_steps)

    @property
    def density(self) -> float:
        """Live fraction of the units of all groups."""
        return sum(self.live.values()) / sum(g.count for g in self.groups.values())

    def summary(self) -> dict[str, Any]:
        """What a training run logs of the driver each epoch: the live fraction of the units."""
        return {"density": self.density}

    @torch.no_grad()
    def apply_masks(self) -> None:
        """Zero the output slices of dead units."""
        foreach_mul_([self.tensors[n] for n in self.masks], list(self.masks.values()))

    def _scores(self) -> dict[str, tuple[Tensor, Tensor]]:
        return {name: self._unit_scores(g) for name, g in self.groups.items()}

    def _mask_gradients(self) -> None:
        for name, mask in self.masks.items():
            if self.tensors[name].grad is not None:
                self.tensors[name].grad.mul_(mask)

    def _unit_scores(self, g: GroupDescription) -> tuple[Tensor, Tensor]:
        """(importance, growth) of every unit of `g` from the current weights and dense gradients."""
        missing = [sl.name for sl in g.slices if self.tensors[sl.name].grad is None]
        if missing:
            raise RuntimeError(f"S²ViTE scores units by gradient, but these have none at an update step: {missing}")
        weights = {sl.name: self.tensors[sl.name].detach() for sl in g.slices}
        grads = {sl.name: self.tensors[sl.name].grad for sl in g.slices}
        growth = unit_reduce(g, grads, lambda u, sl: u.abs())
        if g.kind == UnitKind.HEAD:
            products = {n: weights[n] * grads[n] for n in weights}
            importance = unit_reduce(g, products, lambda u, sl: u if sl.output else torch.zeros_like(u)).abs()
        else:
            importance = unit_reduce(g, weights, lambda u, sl: u.abs())
        return importance, growth

    @torch.no_grad()
    def _update(self, scores: dict[str, tuple[Tensor, Tensor]], rate: float) -> None:
        for name, (importance, growth) in scores.items():
            self.unit_masks[name] = drop_and_revive(self.unit_masks[name], importance, growth, rate)
        self._refresh_masks()
        for name, mask in self.masks.items():
            t = self.tensors[name]
            for value in self.optimizer.state.get(t, {}).values():
                if isinstance(value, Tensor) and value.shape == t.shape:
                    value.mul_(mask)

    def active_units(self) -> dict[str, list[int]]:
        """The live units of every group, by group name."""
        return {name: m.nonzero().flatten().tolist() for name, m in self.unit_masks.items()}

    def export_compact(self, example_inputs: tuple | None = None) -> nn.Module:
        """A copy of the model with the dead units removed (physically smaller, same outputs)."""
        return export_compact(self.model, self.active_units(), example_inputs)

    def export(self, weights: dict[str, Tensor], state: dict[str, Any],
               example_inputs: tuple | None = None) -> nn.Module:
        """The model at `weights` with the units that `state` (a `state_dict()`) leaves dead removed; the live
        model and its masks stay as they are."""
        selected = copy.deepcopy(self.model)
        selected.load_state_dict(weights)
        active = {name: mask.nonzero().flatten().tolist() for name, mask in state["unit_masks"].items()}
        return export_compact(selected, active, example_inputs)

    def state_dict(self) -> dict[str, Any]:
        """Step count, unit masks and RNG state."""
        return {"method": "s2vite", "step": self.step_count, "rng": self.generator.get_state(),
                "unit_masks": {n: m.clone() for n, m in self.unit_masks.items()}}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore a saved state into a `build_s2vite` of a freshly built model with the same arguments."""
        if sd.get("method") != "s2vite" or set(sd["unit_masks"]) != set(self.unit_masks):
            raise ValueError("state_dict comes from another method or another set of unit groups")
        self.unit_masks = {n: m.clone().bool() for n, m in sd["unit_masks"].items()}
        self.step_count = sd["step"]
        self.generator.set_state(sd["rng"])
        self._refresh_masks()
        self.apply_masks()


def drop_and_revive(live: Tensor, importance: Tensor, growth: Tensor, rate: float) -> Tensor:
    """New live mask: drop the ceil(rate * live) live units of lowest importance, then revive as many of the
    highest growth among the units left dead (the just-dropped included); the live count is unchanged."""
    n_live = int(live.sum())
    n_drop = min(n_live, math.ceil(rate * n_live))
    kept = torch.zeros_like(live)
    kept[importance.masked_fill(~live, math.inf).topk(n_drop, largest=False).indices] = True
    kept = live & ~kept
    revived = torch.zeros_like(live)
    revived[growth.masked_fill(kept, -math.inf).topk(n_drop).indices] = True
    return kept | revived


def export_compact(model: nn.Module, active: dict[str, list[int]], example_inputs: tuple | None = None) -> nn.Module:
    """A deep copy of `model` keeping only the `active` units of each named group (fxsurgery group names)."""
    compact = copy.deepcopy(model)
    surgeon = Surgeon(compact, tuple(example_inputs or default_example_inputs(compact)))
    for name, units in active.items():
        group = surgeon.group(name)
        if len(units) < group.count:
            surgeon.keep(group, units)
    return compact


def unit_groups(model: nn.Module, example_inputs: tuple | None = None) -> list[GroupDescription]:
    """fxsurgery's exact head and channel groups of `model` (the analysis leaves `model` untouched)."""
    analysis = analyse(model, tuple(example_inputs or default_example_inputs(model)))
    return [g for g in analysis.groups if g.exact and g.kind in (UnitKind.HEAD, UnitKind.CHANNEL)]


def build_s2vite(model: nn.Module, optimizer: torch.optim.Optimizer, *, density: float = 0.5, total_steps: int,
                 seed: int = 0, head_density: float | None = None, update_interval: int = 100,
                 end_fraction: float = 0.8, death_rate: float = 0.5, min_death_rate: float = 0.005,
                 example_inputs: tuple | None = None) -> StructuredSparse:
    """Keep int(density * count) random units (at least the group's minimum, and one) of every FFN channel group,
    int(head_density * count) of every head group (`head_density` defaults to `density`; the reference's
    other_density and atten_density), and return the S²ViTE driver: call `sp.step()` right after every
    `optimizer.step()`. To resume, build again with the same arguments and call `sp.load_state_dict(sd)`."""
    head_density = density if head_density is None else head_density
    for label, value in (("density", density), ("head_density", head_density)):
        if not 0 < value <= 1:
            raise ValueError(f"{label} must be in (0, 1], got {value}")
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    groups = unit_groups(model, example_inputs)
    if not groups:
        raise ValueError("no exact attention-head or FFN-channel groups found")
    params = {id(p) for group in optimizer.param_groups for p in group["params"]}
    tensors = dict(model.named_parameters())
    if any(sl.name not in tensors or id(tensors[sl.name]) not in params for g in groups for sl in g.slices):
        raise ValueError("the optimizer does not step every parameter of the unit groups")
    kept = {UnitKind.HEAD: head_density, UnitKind.CHANNEL: density}
    live = {g.name: min(g.count, max(1, g.min_count, int(kept[g.kind] * g.count))) for g in groups}
    return StructuredSparse(model, groups, optimizer, live=live, total_steps=total_steps,
                            update_interval=update_interval, end_fraction=end_fraction, death_rate=death_rate,
                            min_death_rate=min_death_rate, generator=torch.Generator().manual_seed(seed))
