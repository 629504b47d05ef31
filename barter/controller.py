"""The BARTER controller: collects scores, runs scheduled transfers after optimizer steps, saves/restores.

It drives a `fxsurgery.Surgeon` through its public API only (groups, tap, remove, clone, attach_optimizer).

Copies: the score taps are forward hooks, closures that `copy.deepcopy` shares rather than copies, so a copied
model would feed the original's tables through the original's groups. While taps are live, the model carries
an instance `__deepcopy__` that copies it without them (a plain compact model), and `copy.deepcopy(ctl)`
gives a controller of a copy of the model and of its optimizer, with its own taps and step hook.
"""
from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

from .averaging import AveragedCopy
from .fsdp import check_optimizer, hold_empty_parameters, sharded_access
from .loss_scale import Scaler, current_scale
from .options import Options
from .schedule import KINDS, Schedule
from .scores import ScoreTable
from .selection import propose

MIN_WIDTH = {"head": 0, "channel": 1}  # attention layers may lose every head, FFNs keep one channel


def _next_forward(table: ScoreTable) -> Any:
    """A forward pre-hook of the model that tells `table` a forward begins."""
    def hook(module: nn.Module, args: tuple) -> None:
        table.next_forward()
    return hook


class Controller:
    """Holds the score tables, schedule, cooldowns and event log of one wrapped model (see `barter.wrap`); a
    `barter.method.TrainingMethod`.

    `layers[kind]` are the exact unit groups of that kind in model order; a layer index in selection is a
    position in that list. With `auto`, `step` runs from a post-step hook of the attached optimizer.
    `edits` counts the surgeries on the model (each resizes tensors and renews their gradient accumulators),
    so a DistributedDataParallel wrapper knows when to rebuild its reducer (`barter.ddp.follow_transfers`).
    Mixed precision: `track_scaler(scaler)` makes the scores those of the unscaled loss; backwards with
    non-finite scores are skipped and counted (`nonfinite_batches`); an optimizer step that did not run
    (GradScaler skips it on inf gradients) is not a step of the schedule.
    """

    state_key = "controller"  # the entry of a training checkpoint that holds `state_dict()`

    def __init__(self, surgeon, layers: dict[str, list], schedule: Schedule, *, method: str, auto: bool,
                 options: Options, select_rng: torch.Generator, noise_rng: torch.Generator,
                 initial_units: dict[str, list[int]] | None = None) -> None:
        self.surgeon = surgeon
        self.layers = layers
        self.method = method
        self.auto = auto
        self.options = options
        self._schedule = schedule
        self._due = {kind: Counter(schedule.steps[kind]) for kind in KINDS}
        self.initial = {kind: [g.count for g in layers[kind]] for kind in KINDS}
        # {group name: indices, in the model as built, of the units compact initialisation kept}
        self.initial_units = dict(initial_units or {})
        self.maximum = {kind: [g.max_count for g in layers[kind]] for kind in KINDS}
        # the method's minimum, raised where fxsurgery cannot go lower (a model whose heads cannot reach 0)
        self.minimum = {kind: [max(MIN_WIDTH[kind], g.min_count) for g in layers[kind]] for kind in KINDS}
        device = next(surgeon.model.parameters()).device
        self.tables = {kind: ScoreTable(self.initial[kind], options.beta, device) for kind in KINDS}
        self.select_rng = select_rng
        self.noise_rng = noise_rng
        self.step_count = 0
        self.edits = 0
        self.events: list[dict[str, Any]] = []
        self._taps: dict[str, list] = {kind: [] for kind in KINDS}
        self._optimizer: torch.optim.Optimizer | None = None
        self._step_hook = None
        self._uncounted = 0  # optimizer steps run since the last counted `step`
        self.scaler: Scaler | None = None
        self.averaged: list[AveragedCopy] = []
        self._install_taps()

    def _install_taps(self) -> None:
        """Tap every group of the kinds with proposals ahead, and tell their tables when a forward of the model
        begins (a layer may be tapped at several places of one forward); the model then copies itself without
        the taps."""
        for kind in KINDS:
            if self.step_count < self._schedule.last(kind):
                table = self.tables[kind]
                self._taps[kind] = [self.surgeon.tap(g, table.tap(i, self._loss_scale))
                                    for i, g in enumerate(self.layers[kind])]
                self._taps[kind].append(self.model.register_forward_pre_hook(_next_forward(table)))
        if any(self._taps.values()):
            self.model.__dict__["__deepcopy__"] = self._copy_model

    def _copy_model(self, memo: dict) -> nn.Module:
        """The model's instance `__deepcopy__`: a copy without this controller's taps."""
        model = self.model
        hook_dicts = {id(d): d for d in (h.hooks_dict_ref() for taps in self._taps.values() for h in taps)
                      if d is not None}
        saved = {key: list(d.items()) for key, d in hook_dicts.items()}
        tap_ids = {h.id for taps in self._taps.values() for h in taps}
        del model.__dict__["__deepcopy__"]
        try:
            for d in hook_dicts.values():
                for hook_id in tap_ids & d.keys():
                    del d[hook_id]
            return copy.deepcopy(model, memo)
        finally:
            for key, d in hook_dicts.items():
                d.clear()
                d.update(saved[key])
            model.__dict__["__deepcopy__"] = self._copy_model

    def __deepcopy__(self, memo: dict) -> "Controller":
        """A controller of a copy of the model (and of the attached optimizer), with its own taps and hook."""
        new = object.__new__(type(self))
        memo[id(self)] = new
        skip = ("_taps", "_step_hook")
        new.__dict__.update(copy.deepcopy({k: v for k, v in self.__dict__.items() if k not in skip}, memo))
        new._taps, new._step_hook = {kind: [] for kind in KINDS}, None
        new._install_taps()
        if new._optimizer is not None:
            new.follow_optimizer(new._optimizer)
        return new

    def _loss_scale(self) -> Tensor | float:
        return current_scale(self.scaler)

    def track_scaler(self, scaler: Scaler | None) -> None:
        """Divide the scores by `scaler`'s loss scale (a `torch.amp.GradScaler`), so they do not depend on it."""
        self.scaler = scaler

    def track(self, averaged: nn.Module) -> None:
        """Make an averaged copy of the model (timm ModelEmaV2/V3, torch AveragedModel) follow every transfer:
        its donor unit is removed and its averaged parent cloned, output weights split (`barter.averaging`)."""
        if all(a.wrapper is not averaged for a in self.averaged):
            self.averaged.append(AveragedCopy(averaged, self.surgeon))

    @property
    def nonfinite_batches(self) -> dict[str, int]:
        """{kind: backwards whose scores were not finite and left the running scores untouched}."""
        for table in self.tables.values():
            table.fold()
        return {kind: int(table.nonfinite) for kind, table in self.tables.items()}

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer whose steps this controller follows."""
        return self._optimizer

    @property
    def model(self) -> nn.Module:
        return self.surgeon.model

    @property
    def schedule(self) -> dict[str, list[int]]:
        """{"head": [...], "channel": [...]}: 1-based optimizer steps after which a proposal runs."""
        return {kind: list(self._schedule.steps[kind]) for kind in KINDS}

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Keep `optimizer`'s state in step with surgery; with `auto`, run `step` after each of its steps."""
        if optimizer is not self._optimizer:
            check_optimizer(self.model, optimizer)
            hold_empty_parameters(self.model)
            self.surgeon.attach_optimizer(optimizer)
            self.follow_optimizer(optimizer)

    def follow_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Remember `optimizer` (already attached to the surgeon) and count its steps; with `auto`, run `step`
        after each of them."""
        self._optimizer = optimizer
        if self._step_hook is not None:
            self._step_hook.remove()
        self._step_hook = optimizer.register_step_post_hook(self._after_optimizer_step)

    def _after_optimizer_step(self, *_: Any) -> None:
        self._uncounted += 1
        if self.auto:
            self.step()

    def step(self) -> None:
        """Count one optimizer step and attempt the proposals scheduled after it (heads, then channels).

        With an optimizer followed, a call when it has not stepped since the last counted call (GradScaler
        skipped its step) does nothing: the schedule counts the optimizer steps that ran."""
        if self._optimizer is not None:
            if self._uncounted == 0:
                return
            self._uncounted = 0
        self.step_count += 1
        self._check_taps_ran()
        for kind in KINDS:
            table = self.tables[kind]
            table.fold()
            for _ in range(self._due[kind][self.step_count]):
                self._attempt(kind)
        self._drop_finished_taps()

    def close(self) -> None:
        """Stop following the optimizer and collecting scores: the step hook and the score taps go (the model
        keeps its widths)."""
        if self._step_hook is not None:
            self._step_hook.remove()
            self._step_hook = None
        self._remove_taps(KINDS)

    def _check_taps_ran(self) -> None:
        """After a training forward and backward (some tap ran), every tapped layer with units must have been
        tapped too: a layer whose tap never ran would keep zero scores and be chosen on ties, blind."""
        ran = {kind: self.tables[kind].take_ran() for kind in KINDS}
        tapped = [(kind, i, g) for kind in KINDS if self._taps[kind] for i, g in enumerate(self.layers[kind])]
        if not any(ran[kind] for kind, _, _ in tapped):
            return  # no training forward since the last step (nothing to score)
        silent = [g.name for kind, i, g in tapped if g.count and i not in ran[kind]]
        if silent:
            raise RuntimeError(f"the score taps of {', '.join(silent)} did not run in this training step while "
                               "others did: the model's forward bypassed the graphs fxsurgery installed (or ran "
                               "them without gradients), so BARTER would choose on zero scores")

    def _attempt(self, kind: str) -> None:
        table, groups = self.tables[kind], self.layers[kind]
        prop = propose(table.D, table.S, table.counts, self.initial[kind], self.maximum[kind],
                       table.blocked(self.step_count), self.minimum[kind], self.method, self.select_rng)
        event = {"step": self.step_count, "kind": kind,
                 "donor_layer": None if prop.donor_layer is None else groups[prop.donor_layer].module,
                 "donor_group": None if prop.donor_layer is None else groups[prop.donor_layer].name,
                 "donor_index": prop.donor_index,
                 "receiver_layer": None if prop.receiver is None else groups[prop.receiver].module,
                 "receiver_group": None if prop.receiver is None else groups[prop.receiver].name,
                 "parent_index": prop.parent, "new_index": None, "skipped": prop.skipped}
        if prop.skipped is None:
            self._prepare_edits()
            self.surgeon.remove(groups[prop.donor_layer], prop.donor_index)
            table.remove(prop.donor_layer, prop.donor_index)
            event["new_index"] = self.surgeon.clone(groups[prop.receiver], prop.parent,
                                                    noise_std=self.options.noise_std, generator=self.noise_rng,
                                                    relative=self.options.noise_relative)
            for averaged in self.averaged:
                averaged.remove(groups[prop.donor_layer].name, prop.donor_index)
                averaged.clone(groups[prop.receiver].name, prop.parent)
            table.clone(prop.receiver, prop.parent, self.step_count + self._schedule.cooldown[kind])
            self.edits += 1
        self.events.append(event)

    def _prepare_edits(self) -> None:
        """Edit through the model's current layout: plain, or sharded by FSDP2 after the wrap (`barter.fsdp`)."""
        if self._optimizer is not None:
            check_optimizer(self.model, self._optimizer)
        access = sharded_access(self.model)
        if access is not None:
            self.surgeon.set_tensor_access(access)

    def _drop_finished_taps(self) -> None:
        """Stop collecting a kind's scores once its last proposal has run: no overhead afterwards."""
        self._remove_taps([kind for kind in KINDS if self.step_count >= self._schedule.last(kind)])

    def _remove_taps(self, kinds: Iterable[str]) -> None:
        for kind in kinds:
            for handle in self._taps[kind]:
                handle.remove()
            self._taps[kind] = []
        if not any(self._taps.values()):
            self.model.__dict__.pop("__deepcopy__", None)

    def topology(self) -> dict[str, dict[str, int]]:
        """{group name: {kind: current unit count}} for every unit group of the model (by name: one host module may
        hold several groups, as a block of two convolutions holds two of channels)."""
        return {g.name: {g.kind: g.count} for g in self.surgeon.groups}

    def metrics(self) -> dict[str, Any]:
        """What a training run logs of the controller each epoch: the backwards whose scores were not finite."""
        return {"nonfinite_score_batches": self.nonfinite_batches}

    def export(self, weights: dict[str, Tensor], state: dict[str, Any],
               example_inputs: tuple | None = None) -> None:
        """None: the model BARTER trains is compact already, so it ships as it is (`barter.export`)."""
        return None

    def scores(self, kind: str) -> dict[str, tuple[Tensor, Tensor]]:
        """{group name: (D, S)} of `kind`, copies of the current running scores."""
        table = self.tables[kind]
        table.fold()
        return {g.name: tuple(x.clone() for x in table.layer(i)) for i, g in enumerate(self.layers[kind])}

    def state_dict(self) -> dict[str, Any]:
        """Scores, cooldowns, step count, RNG states, topology, schedule and events."""
        return {
            "step": self.step_count,
            "method": self.method,
            "schedule": self.schedule,
            "initial": {kind: list(v) for kind, v in self.initial.items()},
            "topology": {g.name: g.count for g in self.surgeon.groups},
            "tables": {kind: t.state_dict() for kind, t in self.tables.items()},
            "rng": {"select": self.select_rng.get_state(), "noise": self.noise_rng.get_state()},
            "events": [dict(e) for e in self.events],
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore a saved controller into a fresh `wrap` of a freshly built model.

        Call it BEFORE `model.load_state_dict` and `optimizer.load_state_dict`: it first brings every unit
        group to the saved count (cloning unit 0 or removing the last units, values irrelevant), so that the
        model's and the optimizer's tensors have the saved shapes when those are loaded next.
        """
        if sd["method"] != self.method or sd["schedule"] != self.schedule or sd["initial"] != self.initial:
            raise ValueError("state_dict comes from a wrap with another method, schedule or initial topology")
        self._prepare_edits()
        for g in self.surgeon.groups:
            target = sd["topology"][g.name]
            while g.count < target:
                self.surgeon.clone(g, 0)
                for averaged in self.averaged:
                    averaged.clone(g.name, 0)
                self.edits += 1
            while g.count > target:
                self.surgeon.remove(g, g.count - 1)
                for averaged in self.averaged:
                    averaged.remove(g.name, g.count)
                self.edits += 1
        for kind, table in self.tables.items():
            table.load_state_dict(sd["tables"][kind])
        self.select_rng.set_state(sd["rng"]["select"])
        self.noise_rng.set_state(sd["rng"]["noise"])
        self.step_count = sd["step"]
        self.events = [dict(e) for e in sd["events"]]
        self._drop_finished_taps()
