"""`SparseTraining`: the abstract base of the mask-based baselines (RigL, SET, SNFS, SRigL, S²ViTE), which updates
their masks on a schedule of optimizer steps and follows the optimizer through a pre-step hook.

    sp = build_baseline("rigl", model, optimizer, density=0.3, total_steps=T, seed=0)
    ... loss.backward(); optimizer.step(); sp.step()
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from ..transfer_event import TransferEvent


class SparseTraining(ABC):
    """Masks updated every `update_interval` optimizer steps before `end_step`; a `barter.method.TrainingMethod`.

    The optimizer's pre-step hook sees every step first: on an update step (t the 1-based step about to run) it
    takes the growth scores from the dense gradients and clears every gradient, so the update replaces the
    optimizer step (torch optimizers skip parameters without a gradient); otherwise it masks the gradients.
    `step()`, right after every `optimizer.step()`, counts it, updates the masks by `drop_fraction(t)` on an
    update step, and zeroes the inactive weights. A method that scores or steps otherwise overrides
    `_before_optimizer_step`. Anything a trainer does to the weights outside `optimizer.step()` (explicit weight
    decay, say) should be skipped when `is_update_step(step_count + 1)` is true before the step.
    """

    state_key = "sparse"  # the entry of a training checkpoint that holds `state_dict()`
    masks: dict[str, Tensor]  # element masks (1 active, 0 inactive) by parameter name

    def __init__(self, optimizer: torch.optim.Optimizer, *, update_interval: int, end_step: int,
                 generator: torch.Generator) -> None:
        self.update_interval = update_interval
        self.end_step = end_step
        self.generator = generator
        self.step_count = 0
        self._pending = False  # the optimizer has stepped since the last `step()`
        self._grow_scores: Any = None
        self._hook: RemovableHandle | None = None
        self.attach_optimizer(optimizer)

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Follow `optimizer` (its pre-step hook, and its moments zeroed where weights grow) instead of any
        optimizer followed before; it must step every masked parameter."""
        self.close()
        self.optimizer = optimizer
        self._hook = optimizer.register_step_pre_hook(self._before_step)

    def close(self) -> None:
        """Stop following the optimizer: its pre-step hook goes (the masks stay as they are)."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def is_update_step(self, step: int) -> bool:
        """Whether 1-based optimizer step `step` is a mask update (every update_interval steps before end_step)."""
        return step % self.update_interval == 0 and step < self.end_step

    @torch.no_grad()
    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._pending:
            raise RuntimeError("call sp.step() after every optimizer.step() of a sparse model")
        self._pending = True
        self._before_optimizer_step(optimizer, update=self.is_update_step(self.step_count + 1))

    def _before_optimizer_step(self, optimizer: torch.optim.Optimizer, *, update: bool) -> None:
        """On an update step take the scores and drop every gradient; otherwise mask the gradients."""
        if update:
            self._grow_scores = self._scores()
            for group in optimizer.param_groups:
                for p in group["params"]:
                    p.grad = None
        else:
            self._mask_gradients()

    def step(self) -> None:
        """Count the optimizer step just taken; on an update step update the masks; then zero the inactive
        weights."""
        if not self._pending:
            raise RuntimeError("sp.step() must follow an optimizer.step() (the optimizer's pre-step hook did not run)")
        self._pending = False
        self.step_count += 1
        if self.is_update_step(self.step_count):
            self._update(self._grow_scores, self.drop_fraction(self.step_count))
            self._grow_scores = None
        self.apply_masks()

    def metrics(self) -> dict[str, Any]:
        """A training run's metrics record logs `summary()` under "sparse"."""
        return {"sparse": self.summary()}

    @property
    def events(self) -> list[TransferEvent]:
        """Empty: masks change, the model's widths do not."""
        return []

    def topology(self) -> None:
        """None: the masked model keeps its widths."""
        return None

    def export(self, weights: dict[str, Tensor], state: dict[str, Any],
               example_inputs: tuple | None = None) -> nn.Module | None:
        """None: the masks remove no whole unit, so the trained model (with its zeros) is what ships."""
        return None

    @property
    @abstractmethod
    def density(self) -> float:
        """The active fraction of what the masks cover."""

    @abstractmethod
    def drop_fraction(self, step: int) -> float:
        """The fraction of the active weights or units dropped at update step `step`."""

    @abstractmethod
    def summary(self) -> dict[str, Any]:
        """What a training run logs of the method each epoch (JSON values)."""

    @abstractmethod
    def apply_masks(self) -> None:
        """Zero the inactive weights."""

    @abstractmethod
    def _mask_gradients(self) -> None:
        """Multiply the masked parameters' gradients by their masks."""

    @abstractmethod
    def _scores(self) -> Any:
        """The growth scores of an update step, from the weights and their dense gradients."""

    @abstractmethod
    def _update(self, scores: Any, fraction: float) -> None:
        """Drop `fraction` of the active weights or units and grow as many by `scores`."""

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Step count, masks and random state."""

    @abstractmethod
    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore a saved state into the method of a freshly built model with the same arguments."""
