"""Every method a training run can train, by name, with how it trains: the one registry that `barter.wrap`, the
baselines, the training config and the `barter` command read (importing no torch)."""
from __future__ import annotations

import enum


class Family(enum.Enum):
    """How a method trains."""

    DENSE = "the model as built, nothing wrapped"
    WRAP = "`barter.wrap`: compact tensors, with transfers or without (static)"
    BASELINE = "`barter.baselines`: dense tensors under masks"


REGISTRY: dict[str, Family] = {
    "dense": Family.DENSE,
    "static": Family.WRAP,
    "barter": Family.WRAP,
    "random_receiver": Family.WRAP,
    "random_donor": Family.WRAP,
    "random_pair": Family.WRAP,
    "rigl": Family.BASELINE,
    "set": Family.BASELINE,
    "snfs": Family.BASELINE,
    "srigl": Family.BASELINE,
    "s2vite": Family.BASELINE,
}


def named(family: Family) -> tuple[str, ...]:
    """The methods of `family`, in the registry's order."""
    return tuple(name for name, found in REGISTRY.items() if found is family)
