"""The BARTER controller: collects scores, runs scheduled transfers after optimizer steps, saves/restores.

It drives a `fxsurgery.Surgeon` through its public API only (groups, tap, remove, clone, attach_optimizer).
"""
from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch import Tensor, nn

from .options import Options
from .schedule import KINDS, Schedule
from .scores import ScoreTable
from .selection import propose

MIN_WIDTH = {"head": 0, "channel": 1}  # attention layers may lose every head, FFNs keep one channel


class Controller:
    """Holds the score tables, schedule, cooldowns and event log of one wrapped model (see `barter.wrap`).

    `layers[kind]` are the exact unit groups of that kind in model order; a layer index in selection is a
    position in that list. With `auto`, `step` runs from a post-step hook of the attached optimizer.
    `edits` counts the surgeries on the model (each resizes tensors and renews their gradient accumulators),
    so a DistributedDataParallel wrapper knows when to rebuild (`barter.DistributedModel`).
    """

    def __init__(self, surgeon, layers: dict[str, list], schedule: Schedule, *, method: str, auto: bool,
                 options: Options, select_rng: torch.Generator, noise_rng: torch.Generator) -> None:
        self.surgeon = surgeon
        self.layers = layers
        self.method = method
        self.auto = auto
        self.options = options
        self._schedule = schedule
        self._due = {kind: Counter(schedule.steps[kind]) for kind in KINDS}
        self.initial = {kind: [g.count for g in layers[kind]] for kind in KINDS}
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
        for kind in KINDS:
            if schedule.steps[kind]:
                self._taps[kind] = [surgeon.tap(g, self.tables[kind].tap(i)) for i, g in enumerate(layers[kind])]

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
            self.surgeon.attach_optimizer(optimizer)
            self.follow_optimizer(optimizer)

    def follow_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Remember `optimizer` (already attached to the surgeon); with `auto`, hook `step` after its steps."""
        self._optimizer = optimizer
        if self.auto:
            if self._step_hook is not None:
                self._step_hook.remove()
            self._step_hook = optimizer.register_step_post_hook(lambda *_: self.step())

    def step(self) -> None:
        """Count one optimizer step and attempt the proposals scheduled after it (heads, then channels)."""
        self.step_count += 1
        for kind in KINDS:
            table = self.tables[kind]
            table.fold()
            for _ in range(self._due[kind][self.step_count]):
                self._attempt(kind)
        self._drop_finished_taps()

    def _attempt(self, kind: str) -> None:
        table, groups = self.tables[kind], self.layers[kind]
        prop = propose(table.D, table.S, table.counts, self.initial[kind], self.maximum[kind],
                       table.blocked(self.step_count), self.minimum[kind], self.method, self.select_rng)
        event = {"step": self.step_count, "kind": kind,
                 "donor_layer": None if prop.donor_layer is None else groups[prop.donor_layer].module,
                 "donor_index": prop.donor_index,
                 "receiver_layer": None if prop.receiver is None else groups[prop.receiver].module,
                 "parent_index": prop.parent, "new_index": None, "skipped": prop.skipped}
        if prop.skipped is None:
            self.surgeon.remove(groups[prop.donor_layer], prop.donor_index)
            table.remove(prop.donor_layer, prop.donor_index)
            event["new_index"] = self.surgeon.clone(groups[prop.receiver], prop.parent,
                                                    noise_std=self.options.noise_std, generator=self.noise_rng,
                                                    relative=self.options.noise_relative)
            table.clone(prop.receiver, prop.parent, self.step_count + self._schedule.cooldown[kind])
            self.edits += 1
        self.events.append(event)

    def _drop_finished_taps(self) -> None:
        """Stop collecting a kind's scores once its last proposal has run: no overhead afterwards."""
        for kind in KINDS:
            if self._taps[kind] and self.step_count >= self._schedule.last(kind):
                for handle in self._taps[kind]:
                    handle.remove()
                self._taps[kind] = []

    def topology(self) -> dict[str, dict[str, int]]:
        """{host module: {kind: current unit count}} for every unit group of the model."""
        out: dict[str, dict[str, int]] = {}
        for g in self.surgeon.groups:
            out.setdefault(g.module, {})[g.kind] = g.count
        return out

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
        for g in self.surgeon.groups:
            target = sd["topology"][g.name]
            while g.count < target:
                self.surgeon.clone(g, 0)
                self.edits += 1
            while g.count > target:
                self.surgeon.remove(g, g.count - 1)
                self.edits += 1
        for kind, table in self.tables.items():
            table.load_state_dict(sd["tables"][kind])
        self.select_rng.set_state(sd["rng"]["select"])
        self.noise_rng.set_state(sd["rng"]["noise"])
        self.step_count = sd["step"]
        self.events = [dict(e) for e in sd["events"]]
        self._drop_finished_taps()
