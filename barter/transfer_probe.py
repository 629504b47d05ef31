"""What one transfer does to the model and to its next updates, recorded in the transfer's event.

The controller records on every executed transfer the running scores its choice was made on
(`choice_scores`): the donor's D (`donor_D`), the receiver layer's R = (n_l,0 / n_l) · mean S (`receiver_R`) and
the parent's S (`parent_S`). With a `TransferProbe` (`Controller.watch_transfers`) the event also gets:

- `probe_loss_before`, `probe_loss_after`: the loss of one fixed probe batch right before the donor's removal and
  right after the clone; `probe_loss_10`, `probe_loss_100`: the same loss after the 10th and the 100th optimizer
  step that follows the transfer's step (None until that step has run, and for a run that ended before it).
- `update_parent`, `update_new`, `update_kept`: the relative update size of the parent, of its new twin and of a
  kept unit of the receiver layer (the lowest-indexed unit that is neither) at each of the `UPDATE_STEPS`
  optimizer steps after the transfer: r_k = ||w_k - w_(k-1)|| / ||w_(k-1)||, where w is the unit's parameter
  elements (every slice of its group in the model's parameters: input rows and biases, output-projection columns)
  and w_0 its values right after the clone. None until the `UPDATE_STEPS`-th step has run; a list that stops
  early if the unit was removed meanwhile; `update_kept` None when the layer had no other unit.

The probe loss is evaluated in eval mode under `torch.no_grad` (each module's train/eval flag restored after): no
dropout or drop-path draws from the random streams, no batch-norm statistics updated, no gradient, so training is
the same with or without the probe. It reads the model's parameters only; its state (what is still due) is saved
with the controller's, so a resumed run fills the same fields as the uninterrupted one.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from .scores import ScoreTable
from .selection import Proposal, receiver_scores
from .transfer_event import DELAYS, PROBE_FIELDS, SCORE_FIELDS, TransferEvent

UPDATE_STEPS = 10  # optimizer steps after a transfer whose relative update sizes are recorded
MEASURED = SCORE_FIELDS + PROBE_FIELDS  # an event's measured numbers, beside its decision (which units moved)
LossFn = Callable[[Tensor, Tensor], Tensor]


def choice_scores(table: ScoreTable, prop: Proposal, initial: list[int], maximum: list[int], *, donor: bool = True,
                  receiver: bool = True) -> dict[str, Any]:
    """{donor_D, receiver_R, parent_S}: the running scores of the units and layer `prop` chose (None for a
    proposal without them, or for the side, `donor` or `receiver`, that the transfer does not run)."""
    out: dict[str, Any] = dict.fromkeys(SCORE_FIELDS)
    offsets = [0, *torch.tensor(table.counts).cumsum(0).tolist()]
    if receiver and prop.receiver is not None:
        out["receiver_R"] = float(receiver_scores(table.S, table.counts, initial, maximum)[prop.receiver])
        out["parent_S"] = float(table.S[offsets[prop.receiver] + prop.parent])
    if donor and prop.donor_layer is not None:
        out["donor_D"] = float(table.D[offsets[prop.donor_layer] + prop.donor_index])
    return out


@contextlib.contextmanager
def inference(model: nn.Module) -> Iterator[None]:
    """Eval mode and no gradient for the block; every module's own train/eval flag restored after."""
    flags = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for module, training in flags:
            module.training = training


def unit_weights(model: nn.Module, group, index: int) -> Tensor:
    """The parameter elements of unit `index` of `group` (all its slices in parameters, flattened, fp32)."""
    params = dict(model.named_parameters())
    parts = [sl.units(params[sl.name].detach(), group.count).select(sl.dim + 1, index).flatten().float()
             for sl in group.slices if sl.name in params]
    return torch.cat(parts)


class _Watched:
    """One unit whose relative update sizes an event waits for."""

    def __init__(self, event: TransferEvent, role: str, group, index: int, last: Tensor,
                 sizes: list[float] | None = None):
        self.event, self.role, self.group, self.index, self.last = event, role, group, index, last
        self.sizes = [] if sizes is None else sizes


class TransferProbe:
    """The probe batch (`inputs`, `targets`, fixed for the run) and the measurements still due (module docstring).

    `loss_fn(outputs, targets)` gives the probe loss (cross-entropy by default)."""

    def __init__(self, inputs: Tensor, targets: Tensor, loss_fn: LossFn | None = None) -> None:
        self.inputs, self.targets = inputs, targets
        self.loss_fn = loss_fn or nn.functional.cross_entropy
        self._due: list[tuple[TransferEvent, int, int]] = []  # (event, delay, step at which it is measured)
        self._watched: list[_Watched] = []
        self._cache: tuple[int, int, float] | None = None  # (step, edits, loss) of the last evaluation

    def loss(self, model: nn.Module) -> float:
        """The probe batch's loss under `model` as it is now (eval mode, no gradient)."""
        with inference(model):
            return float(self.loss_fn(model(self.inputs), self.targets))

    def _loss_at(self, model: nn.Module, step: int, edits: int) -> float:
        """`loss`, evaluated once per (optimizer step, surgery count)."""
        if self._cache is None or self._cache[:2] != (step, edits):
            self._cache = (step, edits, self.loss(model))
        return self._cache[2]

    def before(self, event: TransferEvent, model: nn.Module, step: int, edits: int) -> None:
        """Record the loss before the transfer `event` describes (called before its donor goes)."""
        event.probed, event.probe_loss_before = True, self._loss_at(model, step, edits)

    def after(self, event: TransferEvent, model: nn.Module, groups: dict[str, Any], step: int, edits: int) -> None:
        """Record the loss right after the transfer and start watching its units (called after its clone; a
        transfer that clones nothing, removals only, has no units to watch)."""
        event.probe_loss_after = self._loss_at(model, step, edits)
        self._due += [(event, d, step + d) for d in DELAYS]
        if event.receiver_group is None:
            return
        receiver = groups[event.receiver_group]
        twins = (event.parent_index, event.new_index)
        units = {"parent": twins[0], "new": twins[1],
                 "kept": next((i for i in range(receiver.count) if i not in twins), None)}
        for role, index in units.items():
            if index is not None:
                self._watched.append(_Watched(event, role, receiver, index, unit_weights(model, receiver, index)))

    def removed(self, group: Any, index: int) -> None:
        """Unit `index` of `group` left the model: a watched unit after it moves down one place; the unit itself
        ends its list there."""
        for w in list(self._watched):
            if w.group is group and w.index == index:
                self._finish(w)
            elif w.group is group and w.index > index:
                w.index -= 1

    def step(self, model: nn.Module, step: int, edits: int) -> None:
        """After optimizer step `step` (before its transfers): the delayed losses and update sizes due now."""
        for w in list(self._watched):
            now = unit_weights(model, w.group, w.index)
            w.sizes.append(float((now - w.last).norm() / w.last.norm()))
            w.last = now
            if len(w.sizes) == UPDATE_STEPS:
                self._finish(w)
        due = [item for item in self._due if item[2] == step]
        for event, delay, _ in due:
            setattr(event, f"probe_loss_{delay}", self._loss_at(model, step, edits))
        self._due = [item for item in self._due if item[2] != step]

    def _finish(self, watched: _Watched) -> None:
        setattr(watched.event, f"update_{watched.role}", watched.sizes)
        self._watched.remove(watched)

    def state_dict(self, events: list[TransferEvent]) -> dict[str, Any]:
        """What is still due, events named by their position in `events`."""
        position = {id(e): i for i, e in enumerate(events)}
        return {"due": [(position[id(e)], d, s) for e, d, s in self._due],
                "watched": [{"event": position[id(w.event)], "role": w.role, "group": w.group.name, "index": w.index,
                             "last": w.last.clone(), "sizes": list(w.sizes)} for w in self._watched]}

    def load_state_dict(self, sd: dict[str, Any], events: list[TransferEvent], groups: dict[str, Any]) -> None:
        """Restore `state_dict(events)` against the restored `events` and the model's `groups` by name."""
        self._due = [(events[i], d, s) for i, d, s in sd["due"]]
        self._watched = [_Watched(events[w["event"]], w["role"], groups[w["group"]], w["index"],
                                  w["last"].to(self.inputs.device), list(w["sizes"])) for w in sd["watched"]]
        self._cache = None
