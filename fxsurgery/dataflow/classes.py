"""Classes of ids: connected components of the ties, and parameters joined to the one class they serve."""
from __future__ import annotations

import torch

from .ids import NO_ID, pairs, unique_pairs
from .records import Member


def classes(n: int, edges: list[torch.Tensor]) -> torch.Tensor:
    """Class representative (smallest id) of each of ``n`` ids: connected components of the (k, 2) edges.
    The components are found among the ids the edges touch only (most ids of a deep model, a position table's
    elements say, are tied to none)."""
    rep = torch.arange(n)
    if not edges:
        return rep
    touched, e = torch.unique(unique_pairs(torch.cat(edges)), return_inverse=True)
    rep[touched] = touched[_components(len(touched), e)]  # ascending: the smallest position is the smallest id
    return rep


def _components(n: int, e: torch.Tensor) -> torch.Tensor:
    """Smallest member of each of ``n`` nodes' connected component in the (k, 2) edges ``e``, by vectorised
    min-label propagation with pointer jumping (a few passes over the edge list)."""
    rep = torch.arange(n)
    a, b = e[:, 0], e[:, 1]
    while True:
        low = torch.minimum(rep[a], rep[b])
        new = rep.scatter_reduce(0, a, low, "amin").scatter_reduce(0, b, low, "amin")
        new = torch.minimum(new, new[new])
        while not torch.equal(new, new[new]):
            new = new[new]
        if torch.equal(new, rep):
            return rep
        rep = new


def join_parameters(rep: torch.Tensor, tentative: list[torch.Tensor]) -> torch.Tensor:
    """A parameter element used with one class only joins it (a per-unit parameter); one used with
    several classes is shared by them and stays out (e.g. a norm weight over the head dim). One pass over the
    pairs: an element's partners are one class where the smallest and the largest of them are the same."""
    tent = [t for t in tentative if t.numel()]
    if not tent:
        return rep
    t = torch.cat(tent)
    element, partner = rep[t].unbind(1)
    apart = element != partner
    element, partner = element[apart], partner[apart]
    n = rep.numel()
    low = torch.full((n,), n).scatter_reduce_(0, element, partner, "amin")
    high = torch.full((n,), -1).scatter_reduce_(0, element, partner, "amax")
    single = low == high  # never where an element has no partner (low n, high -1)
    remap = torch.arange(n)
    remap[single] = low[single]
    return remap[rep]


def shared_uses(members: list[Member]) -> list[torch.Tensor]:
    """A parameter used by several calls (a module called by every block) is listed once per call; each
    element is one coordinate, so the ids of its listings of one layout (rows, or columns) are tied. A
    listing of one id (a row of a 1-row weight, or a column of a 1-column one) has no layout to tell by."""
    first: dict[tuple, torch.Tensor] = {}
    ties = []
    for m in members:
        if m.ids.numel() == 1:
            continue
        key = (m.name, tuple(m.ids.shape))
        if key in first:
            ties.append(pairs(first[key], m.ids))
        else:
            first[key] = m.ids
    return ties


class ClassIndex:
    """Which of a list of class tensors hold any of a given set of classes: the classes of every tensor are found
    once, so that each question is one lookup instead of a pass over every tensor."""

    def __init__(self, tensors: list[torch.Tensor], bound: int):
        present = [torch.unique(t[t != NO_ID]) for t in tensors]
        self.bound = bound
        self.classes = torch.cat(present) if present else torch.empty(0, dtype=torch.long)
        self.items = torch.repeat_interleave(torch.arange(len(present)),
                                             torch.tensor([len(p) for p in present], dtype=torch.long))

    def holding(self, wanted: torch.Tensor) -> list[int]:
        """Positions, ascending, of the tensors that hold any of the classes ``wanted`` (all below the bound)."""
        mask = torch.zeros(self.bound, dtype=torch.bool)
        mask[wanted] = True
        return torch.unique(self.items[mask[self.classes]]).tolist()
