"""When transfers are attempted: the reallocation window, the proposal steps and the cooldown lengths.

All step numbers are 1-based optimizer-step counts; a proposal listed at step t runs right after the t-th
optimizer step. Rounding is round-half-up (`rnd`), never Python's banker's `round`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from fxsurgery import UnitKind

KINDS = tuple(UnitKind)  # heads first: the order proposals of one step run in


def rnd(x: float) -> int:
    """Round half up, so 2.5 -> 3 (Python's `round` would give 2)."""
    return math.floor(x + 0.5)


@dataclass(frozen=True)
class Schedule:
    """Proposal steps and donor cooldown length (in steps) per unit kind; `total`: the optimizer steps of the run
    (0: not known)."""

    t_start: int
    t_end: int
    steps: dict[UnitKind, list[int]] = field(default_factory=dict)
    cooldown: dict[UnitKind, int] = field(default_factory=dict)
    total: int = 0

    def last(self, kind: UnitKind) -> int:
        """Step of the last proposal of `kind` (0 if it has none): scores stop being collected after it."""
        return max(self.steps[kind], default=0)


def transfer_count(budget: int, ratio: float, feasible: bool) -> int:
    """K = max(1, rnd(budget * ratio)) for a feasible unit type, else 0."""
    return max(1, rnd(budget * ratio)) if feasible else 0


def make_schedule(total_steps: int, counts: dict[UnitKind, int], window: tuple[float, float] = (0.1, 0.4)) -> Schedule:
    """Spread `counts[kind]` proposals over the window [rnd(w0*T), rnd(w1*T)].

    Channels (and any non-head kind) go at the interval ends rnd(t_start + k*Delta), heads at the
    midpoints rnd(t_start + (k - 1/2)*Delta), k = 1..K, with Delta = (t_end - t_start)/K. Several
    proposals may share a step when K exceeds the window length; none is placed before step 1.

    Cooldown (our choice, making "one head interval / two FFN intervals" hold whatever the rounding of the
    proposal steps): a unit cloned after step t is not a donor at any step t' <= t + L with
    L = ceil(Delta_H) for heads and L = ceil(2*Delta_C) for channels, since two proposals k apart are at
    most ceil(k*Delta) steps apart.
    """
    t_start, t_end = rnd(window[0] * total_steps), rnd(window[1] * total_steps)
    steps: dict[UnitKind, list[int]] = {}
    cooldown: dict[UnitKind, int] = {}
    for kind in KINDS:
        k_total = counts.get(kind, 0)
        if k_total == 0:
            steps[kind], cooldown[kind] = [], 0
            continue
        delta = (t_end - t_start) / k_total
        offset = 0.5 if kind == UnitKind.HEAD else 0.0
        steps[kind] = [max(1, rnd(t_start + (k - offset) * delta)) for k in range(1, k_total + 1)]
        cooldown[kind] = math.ceil(delta if kind == UnitKind.HEAD else 2 * delta)
    return Schedule(t_start, t_end, steps, cooldown, total_steps)
