"""How the parts of a transfer run (`barter.wrap` options), and the named policies that set them all at once.

A transfer removes the donor and clones the parent. `TransferPolicy` says which of the two run
(`TransferParts`), how many transfers are scheduled (`count_scale` times the paper's K) and where (`window`),
what the optimizer state of the clone's two halves starts from (`CloneState`), and how a donor leaves
(`Removal`), and how few heads a transfer may leave in an attention layer (`min_heads`; the paper's 0: a layer may
lose every head). `POLICIES[PolicyName.PAPER]` is the paper's choice for each. `VARIANTS` names the option sets the
studies compare (paper, carry, fade, count0.5, ...).

Width budget when one side runs: the budget is Σ n_l,0 per unit kind at density rho, the units the static
baseline trains, and the model never holds more. Removals only: each transfer removes its donor and clones
nothing, so the width ends K units under the budget. Clones only: the model starts K units under the budget
(taken off at the wrap, one at a time from the widest layer, its last unit; ties to the lower layer) and each
transfer clones its parent without removing anything, so the width ends at the budget. With `Removal.FADE` a donor
is cut only at the end of its fade, one cooldown after its transfer, so the model holds up to one more unit per
fade in progress until then.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from types import MappingProxyType
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
    min_heads: int = 0

    def minimum(self, kind: str) -> int:
        """The fewest units a transfer leaves in a layer of `kind`: an FFN keeps one channel, an attention layer
        `min_heads` heads."""
        return self.min_heads if kind == "head" else 1


POLICIES = {PolicyName.PAPER: TransferPolicy()}
POLICY_ENUMS = {"transfer_policy": PolicyName, "transfer_parts": TransferParts, "clone_state": CloneState,
                "removal": Removal}  # the options whose values are these enums' names


@dataclass(frozen=True)
class Variant:
    """A named set of transfer options that the studies (benchmarks/transfers.py, benchmarks/compress.py,
    `barter compare --variants`) run BARTER under; the options not set stay the paper's."""

    name: str
    summary: str
    options: Mapping[str, object]

    @property
    def label(self) -> str:
        """The studies' row of BARTER under this variant: "barter (fade)"."""
        return f"barter ({self.name})"

    def wrap_options(self) -> dict[str, object]:
        """The `barter.wrap` keyword options, as plain values (an enum by its name) that a config file records."""
        return {key: value.value if isinstance(value, Enum) else value for key, value in self.options.items()}


VARIANTS: Mapping[str, Variant] = MappingProxyType({variant.name: variant for variant in (
    Variant("paper", "the paper's policy", {"transfer_policy": PolicyName.PAPER}),
    Variant("carry", "the parent's moments carried to both halves", {"clone_state": CloneState.CARRY}),
    Variant("restart", "zero moments with a restarted bias correction", {"clone_state": CloneState.RESTART}),
    Variant("fade", "the donor faded out over its cooldown", {"removal": Removal.FADE}),
    Variant("removals", "removals only", {"transfer_parts": TransferParts.REMOVALS}),
    Variant("clones", "clones only", {"transfer_parts": TransferParts.CLONES}),
    Variant("count0.5", "transfer counts x 0.5", {"count_scale": 0.5}),
    Variant("count2", "transfer counts x 2", {"count_scale": 2.0}),
    Variant("keephead", "no transfer takes a layer's last head", {"min_heads": 1}),
)})


def variants_help() -> str:
    """The variants for a command's --help: "paper (the paper's policy), carry (...), ..."."""
    return ", ".join(f"{variant.name} ({variant.summary})" for variant in VARIANTS.values())
