"""The BARTER controller: collects scores, runs scheduled transfers after optimizer steps, saves/restores.

It drives a `fxsurgery.Surgeon` through its public API only (groups, tap, remove, clone, attach_optimizer).

Copies: the score taps are forward hooks, closures that `copy.deepcopy` shares rather than copies, so a copied
model would feed the original's tables through the original's groups. While taps are live, the model carries
an instance `__deepcopy__` that copies it without them (a plain compact model), and `copy.deepcopy(ctl)`
gives a controller of a copy of the model and of its optimizer, with its own taps and step hook.
"""
from __future__ import annotations

import copy
import weakref
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor, nn

from fxsurgery import UnitKind, correct_restarted

from .averaging import AveragedCopy
from .compat import copy_plainly, copy_with, hooks_set_aside
from .fsdp import check_optimizer, hold_empty_parameters, sharded_access
from .loss_scale import Scaler, current_scale
from .meta_build import restore_installed
from .options import Options
from .schedule import KINDS, Schedule
from .scores import ScoreTable
from .selection import propose
from .transfer_event import TransferEvent
from .transfer_policy import CloneState, Removal, TransferParts
from .transfer_probe import LossFn, TransferProbe, choice_scores


class _RestoreInstalled:
    """A forward pre-hook on a model `barter.wrap` wrapped on the meta device whose install added buffers: at its first
    call with its values allocated (`to_empty`), before any step, those buffers get the values the wrap kept
    (`meta_build.restore_installed`; a build replayed by `meta_build.materialise` got them already), then it goes."""

    def __init__(self, controller: Controller):
        self.controller = weakref.ref(controller)
        self.handle = controller.model.register_forward_pre_hook(self)

    def __call__(self, module: nn.Module, args: tuple) -> None:
        controller = self.controller()
        if controller is not None and any(p.is_meta for p in module.parameters()):
            return
        self.handle.remove()
        if controller is not None and controller.step_count == 0:  # after a resume the buffers are as loaded
            restore_installed(controller, module)

@dataclass
class Fade:
    """A donor on its way out (`Removal.FADE`): its output weights are scaled to 1 − j/length of their value
    after the j-th counted step since `start`, and it is removed after the step where that reaches 0."""

    kind: UnitKind
    layer: int
    index: int
    start: int
    length: int


def _by_text(by_kind: dict[UnitKind, Any]) -> dict[str, Any]:
    """`by_kind` keyed by each kind's text (what a checkpoint and a metrics record hold)."""
    return {kind.value: value for kind, value in by_kind.items()}


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

    def __init__(self, surgeon, layers: dict[UnitKind, list], schedule: Schedule, *, method: str, auto: bool,
                 options: Options, select_rng: torch.Generator, noise_rng: torch.Generator,
                 initial_units: dict[str, list[int]] | None = None) -> None:
        self.surgeon = surgeon
        self.layers = layers
        self.method = method
        self.auto = auto
        self.options = options
        self.policy = options.policy  # the parts of a transfer (`barter.transfer_policy.TransferPolicy`)
        self._schedule = schedule
        self._due = {kind: Counter(schedule.steps[kind]) for kind in KINDS}
        self.initial = {kind: [g.count for g in layers[kind]] for kind in KINDS}
        # {group name: indices, in the model as built, of the units compact initialisation kept}
        self.initial_units = dict(initial_units or {})
        self.maximum = {kind: [g.max_count for g in layers[kind]] for kind in KINDS}
        # the policy's minimum, raised where fxsurgery cannot go lower (a model whose heads cannot reach 0)
        self.minimum = {kind: [max(options.policy.minimum(kind), g.min_count) for g in layers[kind]]
                        for kind in KINDS}
        device = next(surgeon.model.parameters()).device
        self.tables = {kind: ScoreTable(self.initial[kind], options.beta, device) for kind in KINDS}
        self.select_rng = select_rng
        self.noise_rng = noise_rng
        self.noise_seeded_on_meta = device.type == "meta"  # follows the weights once they exist
        self.step_count = 0
        self.edits = 0
        self.events: list[TransferEvent] = []
        self.fading: list[Fade] = []
        self._taps: dict[UnitKind, list] = {kind: [] for kind in KINDS}
        self._optimizer: torch.optim.Optimizer | None = None
        self._step_hook = None
        self._uncounted = 0  # optimizer steps run since the last counted `step`
        self.scaler: Scaler | None = None
        self.averaged: list[AveragedCopy] = []
        self.probe: TransferProbe | None = None
        if self.noise_seeded_on_meta and self.surgeon.installed_state():
            _RestoreInstalled(self)
        self._install_taps()

    def _install_taps(self) -> None:
        """Tap every group of the kinds with proposals ahead, and tell their tables when a forward of the model
        begins (a layer may be tapped at several places of one forward); the model then copies itself without
        the taps."""
        for kind in KINDS:
            if self.step_count < self._schedule.last(kind):
                table = self.tables[kind]
                self._taps[kind] = [self.surgeon.tap(g, table.tap(i, self._loss_scale), grad_only=True)
                                    for i, g in enumerate(self.layers[kind])]
                self._taps[kind].append(self.model.register_forward_pre_hook(_next_forward(table)))
        if any(self._taps.values()):
            copy_with(self.model, self._copy_model)

    def _copy_model(self, memo: dict) -> nn.Module:
        """The model's instance `__deepcopy__`: a copy without this controller's taps."""
        copy_plainly(self.model)
        try:
            with hooks_set_aside(h for taps in self._taps.values() for h in taps):
                return copy.deepcopy(self.model, memo)
        finally:
            copy_with(self.model, self._copy_model)

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
        """{kind's text: backwards whose scores were not finite and left the running scores untouched}."""
        for table in self.tables.values():
            table.fold()
        return _by_text({kind: int(table.nonfinite) for kind, table in self.tables.items()})

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer whose steps this controller follows."""
        return self._optimizer

    @property
    def model(self) -> nn.Module:
        return self.surgeon.model

    @property
    def schedule(self) -> dict[UnitKind, list[int]]:
        """{"head": [...], "channel": [...]}: 1-based optimizer steps after which a proposal runs."""
        return {kind: list(self._schedule.steps[kind]) for kind in KINDS}

    def watch_transfers(self, inputs: Tensor, targets: Tensor, loss_fn: LossFn | None = None) -> None:
        """Record in every executed transfer's event the loss of the fixed batch (`inputs`, `targets`) around it
        and the relative update sizes of its units after it (`barter.transfer_probe`; training is unchanged).
        A resumed run calls it before `load_state_dict`, which restores what was due. Reads whole parameters: not
        for a model sharded by FSDP2 (`barter train` leaves it off there)."""
        self.probe = TransferProbe(inputs, targets, loss_fn)

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
        if self.policy.clone_state is CloneState.RESTART and not isinstance(optimizer, torch.optim.Adam):
            raise ValueError(f"clone_state 'restart' restarts Adam's bias correction; {type(optimizer).__name__} "
                             "has none (use Adam or AdamW, or clone_state 'paper' or 'carry')")
        self._optimizer = optimizer
        if self._step_hook is not None:
            self._step_hook.remove()
        self._step_hook = optimizer.register_step_post_hook(self._after_optimizer_step)

    def _after_optimizer_step(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        if self.policy.clone_state is CloneState.RESTART:
            correct_restarted(optimizer)
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
        self._follow_materialised()
        self._check_taps_ran()
        if self.probe is not None:
            self.probe.step(self.model, self.step_count, self.edits)
        self._advance_fades()
        for kind in KINDS:
            table = self.tables[kind]
            table.fold()
            for _ in range(self._due[kind][self.step_count]):
                self._attempt(kind)
        self._drop_finished_taps()

    def _follow_materialised(self) -> None:
        """A model wrapped on the meta device and materialised since (``to_empty``): the split noise is drawn on
        the device its weights are on now, seeded as `wrap` seeded it (nothing was drawn on meta), and the score
        tables are there too."""
        if not self.noise_seeded_on_meta:  # the common case, and every step after the first real one: nothing to do
            return
        device = next(self.model.parameters()).device
        if device.type == "meta":
            return
        if self.noise_rng.device != device:
            self.noise_rng = torch.Generator(device=device).manual_seed(self.noise_rng.initial_seed())
        self.noise_seeded_on_meta = False
        for table in self.tables.values():
            table.materialise(device)

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

    def _attempt(self, kind: UnitKind) -> None:
        """One proposal of `kind`, executed as the transfer policy says: the donor removed (or set fading), the
        parent cloned, or one of the two only."""
        table, groups, policy = self.tables[kind], self.layers[kind], self.policy
        prop = propose(table.D, table.S, table.counts, self.initial[kind], self.maximum[kind],
                       table.blocked(self.step_count), self.minimum[kind], self.method, self.select_rng,
                       leaving=self._leaving(kind))
        clones_only = policy.transfer_parts is TransferParts.CLONES
        skipped = None if clones_only and prop.skipped == "no eligible donor" else prop.skipped
        removes = skipped is None and not clones_only
        clones = skipped is None and policy.transfer_parts is not TransferParts.REMOVALS
        # an executed transfer names the parts that ran; a skipped proposal, what it had chosen
        donor = prop.donor_layer is not None and (removes or skipped is not None)
        receiver = prop.receiver is not None and (clones or skipped is not None)
        event = TransferEvent(
            step=self.step_count, kind=kind, skipped=skipped,
            donor_layer=groups[prop.donor_layer].module if donor else None,
            donor_group=groups[prop.donor_layer].name if donor else None,
            donor_index=prop.donor_index if donor else None,
            receiver_layer=groups[prop.receiver].module if receiver else None,
            receiver_group=groups[prop.receiver].name if receiver else None,
            parent_index=prop.parent if receiver else None,
            **choice_scores(table, prop, self.initial[kind], self.maximum[kind], donor=donor, receiver=receiver))
        if removes or clones:
            if self.probe is not None:
                self.probe.before(event, self.model, self.step_count, self.edits)
            self._prepare_edits()
        fade = self._fade_length(kind) if removes and policy.removal is Removal.FADE else 0
        if removes and policy.removal is Removal.FADE:
            event.removed_at = self.step_count + fade
        if fade:
            self.fading.append(Fade(kind, prop.donor_layer, prop.donor_index, self.step_count, fade))
        elif removes:
            self._remove(kind, prop.donor_layer, prop.donor_index)
        if clones:
            event.new_index = self.surgeon.clone(groups[prop.receiver], prop.parent,
                                                 noise_std=self.options.noise_std, generator=self.noise_rng,
                                                 relative=self.options.noise_relative,
                                                 state=policy.clone_state.surgery)
            for averaged in self.averaged:
                averaged.clone(groups[prop.receiver].name, prop.parent)
            table.clone(prop.receiver, prop.parent, self.step_count + self._schedule.cooldown[kind])
        if clones or (removes and not fade):
            self.edits += 1
        if (removes or clones) and self.probe is not None:
            self.probe.after(event, self.model, {g.name: g for g in groups}, self.step_count, self.edits)
        self.events.append(event)

    def _fade_length(self, kind: UnitKind) -> int:
        """Steps a donor of `kind` fades over: its cooldown, cut short to end by the run's last step (0 at the last
        step itself: it is removed at once)."""
        length = self._schedule.cooldown[kind]
        total = self._schedule.total
        return max(0, min(length, total - self.step_count)) if total else length

    def _remove(self, kind: UnitKind, layer: int, index: int) -> None:
        """Remove a donor from the model, its scores and the averaged copies; fading units after it in its layer
        move down one place."""
        group = self.layers[kind][layer]
        self.surgeon.remove(group, index)
        self.tables[kind].remove(layer, index)
        if self.probe is not None:
            self.probe.removed(group, index)
        for averaged in self.averaged:
            averaged.remove(group.name, index)
        for fade in self.fading:
            if (fade.kind, fade.layer) == (kind, layer) and fade.index > index:
                fade.index -= 1

    def _leaving(self, kind: UnitKind) -> Tensor | None:
        """Flat bool over `kind`'s units: True for the fading ones (None when none fades)."""
        fades = [f for f in self.fading if f.kind == kind]
        if not fades:
            return None
        counts = self.tables[kind].counts
        leaving = torch.zeros(sum(counts), dtype=torch.bool)
        for fade in fades:
            leaving[sum(counts[:fade.layer]) + fade.index] = True
        return leaving

    def _advance_fades(self) -> None:
        """After a counted step: scale each fading donor's output weights down one more step of its linear fade
        (from 1 − (j−1)/L to 1 − j/L of their value), and remove the donors that reached 0."""
        if self.fading:
            self._prepare_edits()
        for fade in list(self.fading):
            j = self.step_count - fade.start
            group = self.layers[fade.kind][fade.layer]
            self.surgeon.scale_output(group, fade.index, max(fade.length - j, 0) / (fade.length - j + 1))
            if j >= fade.length:
                self.fading.remove(fade)
                self._remove(fade.kind, fade.layer, fade.index)
                self.edits += 1

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

    def _remove_taps(self, kinds: Iterable[UnitKind]) -> None:
        for kind in kinds:
            for handle in self._taps[kind]:
                handle.remove()
            self._taps[kind] = []
        if not any(self._taps.values()):
            copy_plainly(self.model)

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

    def scores(self, kind: UnitKind) -> dict[str, tuple[Tensor, Tensor]]:
        """{group name: (D, S)} of `kind`, copies of the current running scores."""
        table = self.tables[kind]
        table.fold()
        return {g.name: tuple(x.clone() for x in table.layer(i)) for i, g in enumerate(self.layers[kind])}

    def state_dict(self) -> dict[str, Any]:
        """Scores, cooldowns, step count, RNG states, topology, schedule and events (kinds as their text: what
        `torch.load(weights_only=True)` reads)."""
        return {
            "step": self.step_count,
            "method": self.method,
            "schedule": _by_text(self.schedule),
            "initial": _by_text({kind: list(v) for kind, v in self.initial.items()}),
            "topology": {g.name: g.count for g in self.surgeon.groups},
            "tables": _by_text({kind: t.state_dict() for kind, t in self.tables.items()}),
            "rng": {"select": self.select_rng.get_state(), "noise": self.noise_rng.get_state()},
            "events": [e.record() for e in self.events],
            **({} if self.probe is None else {"probe": self.probe.state_dict(self.events)}),
            "fading": [{**asdict(f), "kind": f.kind.value} for f in self.fading],
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore a saved controller into a fresh `wrap` of a freshly built model.

        Call it BEFORE `model.load_state_dict` and `optimizer.load_state_dict`: it first brings every unit
        group to the saved count (cloning unit 0 or removing the last units, values irrelevant), so that the
        model's and the optimizer's tensors have the saved shapes when those are loaded next.
        """
        if sd["method"] != self.method or sd["schedule"] != self.schedule or sd["initial"] != self.initial:
            raise ValueError("state_dict comes from a wrap with another method, schedule or initial topology")
        self._follow_materialised()  # a model wrapped on meta: its tables and noise move first, then take the state
        if self.noise_seeded_on_meta:
            raise ValueError("the model is on the meta device: its saved scores and generators have nowhere to go; "
                             "materialise it (to_empty) before ctl.load_state_dict")
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
        self.events = [TransferEvent.from_record(e) for e in sd["events"]]
        if self.probe is not None and "probe" in sd:
            self.probe.load_state_dict(sd["probe"], self.events, {g.name: g for g in self.surgeon.groups})
        self.fading = [Fade(**{**f, "kind": UnitKind(f["kind"])}) for f in sd.get("fading", [])]
        self._drop_finished_taps()
