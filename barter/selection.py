"""Which units one transfer moves: receiver layer, clone parent and donor unit (method steps 1-4).

Pure functions on flat score vectors (layer after layer, units in order inside a layer), so they can be
tested on hand-built tables and know nothing of models. Ties break towards the lowest layer index, then the
lowest unit index: `argmax`/`argmin` on the flat vectors return the first extreme.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor


@dataclass(frozen=True)
class Proposal:
    """A selected transfer (layers are indices into the kind's layer list), or the reason it is skipped."""

    receiver: int | None = None
    parent: int | None = None
    donor_layer: int | None = None
    donor_index: int | None = None
    skipped: str | None = None


def _uniform(n: int, generator: torch.Generator) -> int:
    return int(torch.randint(n, (1,), generator=generator).item())


def receiver_scores(S: Tensor, counts: Sequence[int], initial: Sequence[int], maximum: Sequence[int],
                    staying: Sequence[int] | None = None) -> Tensor:
    """R_l = (n_l,0 / n_l) * mean S over layer l for eligible layers (0 < n_l < n_l^max, and some unit `staying`,
    not leaving), -inf elsewhere; computed as n_l,0 * sum S / n_l² with one rounding, so layers that tie exactly
    stay tied (and the lower index wins)."""
    out = torch.full((len(counts),), float("-inf"), dtype=torch.float64)
    staying = counts if staying is None else staying
    for layer, seg in enumerate(S.split(list(counts))):
        n = counts[layer]
        if 0 < staying[layer] and n < maximum[layer]:
            out[layer] = initial[layer] * seg.double().sum() / (n * n)
    return out


def donor_mask(counts: Sequence[int], receiver: int, blocked: Tensor, min_width: Sequence[int],
               staying: Sequence[int] | None = None) -> Tensor:
    """Units outside the receiver, not blocked (in cooldown, or leaving), whose layer keeps >= its min_width units
    after removal (of the units `staying` there, when some are leaving)."""
    staying = counts if staying is None else staying
    ok_layer = torch.tensor([staying[layer] - 1 >= min_width[layer] and layer != receiver
                             for layer in range(len(counts))])
    return ok_layer.repeat_interleave(torch.tensor(list(counts), dtype=torch.long)) & ~blocked.cpu()


def propose(D: Tensor, S: Tensor, counts: Sequence[int], initial: Sequence[int], maximum: Sequence[int],
            blocked: Tensor, min_width: Sequence[int], method: str, generator: torch.Generator,
            leaving: Tensor | None = None) -> Proposal:
    """Select one transfer of a unit kind.

    D, S: flat running scores; blocked: flat bool, True for units in cooldown; min_width: per layer, the
    fewest units it may keep (1 for FFN channels, 0 for heads). leaving: flat bool, True for units on their way
    out (a fading donor): neither parent nor donor, and not counted in their layer's width. The random variants
    draw from `generator` (receiver, then parent, then donor).
    """
    if not (torch.isfinite(D).all() and torch.isfinite(S).all()):
        return Proposal(skipped="non-finite scores")
    staying, parents = None, S
    if leaving is not None and bool(leaving.any()):
        staying = [int((~seg).sum()) for seg in leaving.cpu().split(list(counts))]
        blocked = blocked.cpu() | leaving.cpu()
        parents = torch.where(leaving.to(S.device), float("-inf"), S)
    R = receiver_scores(S, counts, initial, maximum, staying)
    eligible = torch.isfinite(R).nonzero().flatten()
    if len(eligible) == 0:
        return Proposal(skipped="no eligible receiver")
    random_receiver = method in ("random_receiver", "random_pair")
    r = int(eligible[_uniform(len(eligible), generator)]) if random_receiver else int(R.argmax())
    start = sum(counts[:r])
    if random_receiver:
        stays = [i for i in range(counts[r]) if staying is None or not bool(leaving[start + i])]
        parent = stays[_uniform(len(stays), generator)]
    else:
        parent = int(parents[start:start + counts[r]].argmax())
    mask = donor_mask(counts, r, blocked, min_width, staying)
    candidates = mask.nonzero().flatten()
    if len(candidates) == 0:
        return Proposal(receiver=r, parent=parent, skipped="no eligible donor")
    if method in ("random_donor", "random_pair"):
        flat = int(candidates[_uniform(len(candidates), generator)])
    else:
        flat = int(torch.where(mask, D.double().cpu(), float("inf")).argmin())
    layer = int(torch.searchsorted(torch.tensor(list(counts)).cumsum(0), flat, right=True))
    return Proposal(receiver=r, parent=parent, donor_layer=layer, donor_index=flat - sum(counts[:layer]))
