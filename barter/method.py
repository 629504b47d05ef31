"""`TrainingMethod`: the one protocol a training loop drives every method through (BARTER's `Controller`, each
baseline of `barter.baselines`, `Dense`), so that the loop and its checkpoints never ask which method runs.

    method.attach_optimizer(optimizer)      # follow this optimizer's steps (the builders attach theirs)
    ... loss.backward(); optimizer.step(); method.step()
    checkpoint[method.state_key] = method.state_dict()
    method.close()                          # the run is over: every hook the method installed goes
"""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from .transfer_event import TransferEvent


@runtime_checkable
class TrainingMethod(Protocol):
    """What a training loop reads of a method that trains a model (see each implementation for its details).

    `step()` runs right after every `optimizer.step()` (or `scaler.step`): it counts the step and runs what the
    method scheduled after it. A resumed run builds the method afresh with the same arguments and calls
    `load_state_dict` before loading the model's and the optimizer's states (BARTER restores the saved widths
    first).
    """

    state_key: str  # the entry of a training checkpoint that holds `state_dict()`

    @property
    def events(self) -> list[TransferEvent]:
        """The log of the method's edits to the model's widths (empty for a method that keeps them)."""

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Follow `optimizer`'s steps (in place of any optimizer followed before)."""

    def step(self) -> None:
        """Count the optimizer step just taken and run what the method scheduled after it."""

    def state_dict(self) -> dict[str, Any]:
        """What resuming needs of the method."""

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore `state_dict()` into the method of a freshly built model."""

    def metrics(self) -> dict[str, Any]:
        """The entries the method adds to a run's per-epoch metrics record (JSON values)."""

    def topology(self) -> dict[str, dict[str, int]] | None:
        """{group name: {kind: unit count}} for a method that changes the model's widths; None otherwise."""

    def export(self, weights: dict[str, Tensor], state: dict[str, Any],
               example_inputs: tuple | None = None) -> nn.Module | None:
        """The model trained to `weights`, with the method in `state` (a checkpoint's), as it ships when that is
        smaller than the model trained (dead units removed); None when the trained model is what ships."""

    def close(self) -> None:
        """Remove every hook the method installed on the model and the optimizer."""


class Dense:
    """Dense training as a `TrainingMethod`: the model trains as it is, with nothing to step, save or log."""

    state_key = "dense"

    @property
    def events(self) -> list[TransferEvent]:
        return []

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        pass

    def step(self) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if sd:
            raise ValueError("state_dict comes from a method other than dense training")

    def metrics(self) -> dict[str, Any]:
        return {}

    def topology(self) -> None:
        return None

    def export(self, weights: dict[str, Tensor], state: dict[str, Any], example_inputs: tuple | None = None) -> None:
        return None

    def close(self) -> None:
        pass
