"""How the parts of a transfer run (`barter.wrap` options), and the named policies that set them all at once.

A transfer removes the donor and clones the parent. `TransferPolicy` says which of the two run
(`TransferParts`), how many transfers are scheduled (`count_scale` times the paper's K) and where (`window`),
what the optimizer state of the clone's two halves starts from (`CloneState`), and how a donor leaves
(`Removal`). `POLICIES[PolicyName.PAPER]` is the paper's choice for each.

Width budget when one side runs: the budget is Σ n_l,0 per unit kind at density rho, the units the static
baseline trains, and the model never holds more. Removals only: each transfer removes its donor and clones
nothing, so the width ends K units under the budget. Clones only: the model starts K units under the budget
(taken off at the wrap, one at a time from the widest layer, its last unit; ties to the lower layer) and each
transfer clones its parent without removing anything, so the width ends at the budget. With `Removal.FADE` a donor
is cut only at the end of its fade, one cooldown after its transfer, so the model holds up to one more unit per
fade in progress until then.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fxsurgery import StateAtClone


class TransferParts(str, Enum):
    """Which parts of a transfer run: both (the paper), the donor's removal only, the parent's clone only."""

    BOTH = "both"
    REMOVALS = "removals"
    CLONES = "clones"


class CloneState(str, Enum):
    """Optimizer state of the parent and its copy after a clone. paper: zero moments, step counter kept; carry:
    the parent's moments scaled as the split scales the weights (output slices: first moment / 2, second / 4;
    input slices copied); restart: zero moments with Adam's bias correction restarted for their elements
    (`fxsurgery.clone_state`)."""

    PAPER = "paper"
    CARRY = "carry"
    RESTART = "restart"

    @property
    def surgery(self) -> StateAtClone:
        """fxsurgery's generic name of this state (imported here: the `barter` command's parser reads this module
        without importing torch)."""
        from fxsurgery import StateAtClone

        return {CloneState.PAPER: StateAtClone.ZERO, CloneState.CARRY: StateAtClone.SPLIT,
                CloneState.RESTART: StateAtClone.RESTART}[self]


class Removal(str, Enum):
    """How a donor leaves. paper: removed at its transfer; fade: its output weights scaled linearly to zero over
    the cooldown of its kind (1 − j/L after the j-th step of L; cut short to end by the run's last step), then
    removed, which then changes nothing."""

    PAPER = "paper"
    FADE = "fade"


class PolicyName(str, Enum):
    """A named transfer policy (`POLICIES`)."""

    PAPER = "paper"


@dataclass(frozen=True)
class TransferPolicy:
    """The parts of a transfer and their schedule: see the module docstring."""

    transfer_parts: TransferParts = TransferParts.BOTH
    count_scale: float = 1.0
    window: tuple[float, float] = (0.1, 0.4)
    clone_state: CloneState = CloneState.PAPER
    removal: Removal = Removal.PAPER


POLICIES = {PolicyName.PAPER: TransferPolicy()}
POLICY_ENUMS = {"transfer_policy": PolicyName, "transfer_parts": TransferParts, "clone_state": CloneState,
                "removal": Removal}  # the options whose values are these enums' names
