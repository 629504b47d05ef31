"""Classes of ids: connected components of the ties, and parameters joined to the one class they serve."""
from __future__ import annotations

import torch

from .ids import NO_ID, pairs
from .records import Member


def classes(n: int, edges: list[torch.Tensor]) -> torch.Tensor:
    """Class representative (smallest id) of each of ``n`` ids: connected components of the (k, 2) edges.
    The components are found among the ids the edges touch only (most ids of a deep model, a position table's
    elements say, are tied to none), numbered by a bitmap over the ids instead of a sort."""
    rep = torch.arange(n)
    if not edges:
        return rep
    ends = torch.cat(edges).reshape(-1)
    seen = torch.zeros(n, dtype=torch.bool).index_fill_(0, ends, True)
    touched = seen.nonzero().flatten()  # ascending: the smallest position is the smallest id
    position = torch.cumsum(seen, 0) - 1
    e = position.index_select(0, ends).view(-1, 2)
    return rep.index_copy_(0, touched, touched.index_select(0, _components(len(touched), e)))


def _components(n: int, e: torch.Tensor) -> torch.Tensor:
    """Smallest member of each of ``n`` nodes' connected component in the (k, 2) edges ``e``, by vectorised
    min-label propagation with pointer jumping (a few passes over the edge list; repeated edges change nothing)."""
    rep = torch.arange(n)
    a, b = e[:, 0].contiguous(), e[:, 1].contiguous()
    while True:
        low = torch.minimum(rep.index_select(0, a), rep.index_select(0, b))
        new = rep.scatter_reduce(0, a, low, "amin").scatter_reduce(0, b, low, "amin")
        new = torch.minimum(new, new.index_select(0, new))
        jumped = new.index_select(0, new)
        while not torch.equal(new, jumped):
            new, jumped = jumped, jumped.index_select(0, jumped)
        if torch.equal(new, rep):
            return rep
        rep = new


def join_parameters(rep: torch.Tensor, tentative: list[torch.Tensor]) -> torch.Tensor:
    """Each entry of ``tentative`` is one use of parameter elements beside activation ids (an elementwise op). An
    element that meets one class in each of its uses joins them (a per-unit parameter; a per-head bias table every
    layer adds ties head h of each layer into one unit); one that meets several classes in one use is broadcast
    beside them, shared by them, and stays out (a norm weight over the head dim, a position table every head
    multiplies). A pair within one class counts as no partner. Where a use meets one class only (a layer of one
    head), an element that would join several is shared too if in that use several elements of it meet the class
    along several of its coordinates (a rotary table every layer's head multiplies): a per-head table read by the
    scores meets one id of the head in each use, and still joins."""
    tent = [t for t in tentative if t.numel()]
    if not tent:
        return rep
    n = rep.numel()
    use = torch.cat([torch.full((len(t),), k) for k, t in enumerate(tent)])
    element, partner = rep.index_select(0, torch.cat(tent).reshape(-1)).view(-1, 2).unbind(1)
    apart = element != partner
    use, element, partner = use[apart], element[apart], partner[apart]
    if not element.numel():
        return rep
    keys, which = torch.unique(use * n + element, return_inverse=True)
    low = torch.full((len(keys),), n).scatter_reduce_(0, which, partner, "amin")
    high = torch.full((len(keys),), -1).scatter_reduce_(0, which, partner, "amax")
    shared = torch.zeros(n, dtype=torch.bool).index_fill_(0, (keys % n)[low != high], True)
    along = _along_one_class(use, partner, torch.cat(tent)[apart], n)
    shared.index_fill_(0, element[along & _spans_classes(element, partner, n)], True)
    joined = ~shared.index_select(0, element)
    ids = torch.arange(n)
    moved = rep != ids
    return classes(n, [torch.stack([ids[moved], rep[moved]], 1),
                       torch.stack([element[joined], partner[joined]], 1)])


def _along_one_class(use: torch.Tensor, partner: torch.Tensor, raw: torch.Tensor, n: int) -> torch.Tensor:
    """For each pair (``raw``: its element and activation ids): whether its use meets one class only, with several
    elements meeting several coordinates of it (a rotary table read along a layer's one head), rather than each
    element meeting one id of it (a per-head table read by the scores of that head)."""
    uses = int(use.max()) + 1

    def distinct(ids: torch.Tensor) -> torch.Tensor:  # of the ids below n, per use (pairs packed in one int64)
        return torch.bincount(torch.unique(use * n + ids) // n, minlength=uses)
    along = (distinct(raw[:, 0]) > 1) & (distinct(raw[:, 1]) > 1) & (distinct(partner) == 1)
    return along.index_select(0, use)


def _spans_classes(element: torch.Tensor, partner: torch.Tensor, n: int) -> torch.Tensor:
    """For each pair: whether its element meets more than one class over all its uses."""
    low = torch.full((n,), n).scatter_reduce_(0, element, partner, "amin")
    high = torch.full((n,), -1).scatter_reduce_(0, element, partner, "amax")
    return (low != high).index_select(0, element)


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
    """Which of a list of class tensors hold any of a given set of classes: the classes of every tensor are listed
    once, side by side, so that each question is one lookup instead of a pass over every tensor."""

    def __init__(self, tensors: list[torch.Tensor], bound: int):
        flat = [t.reshape(-1) for t in tensors]
        found = torch.cat(flat) if flat else torch.empty(0, dtype=torch.long)
        items = torch.repeat_interleave(torch.arange(len(flat)), torch.tensor([len(f) for f in flat], dtype=torch.long))
        held = found != NO_ID
        self.bound = bound
        # items ascend; a class a tensor holds twice is listed twice, which no answer minds
        self.classes, self.items = found.masked_select(held), items.masked_select(held)

    def by_group(self, group_of: torch.Tensor, count: int) -> list[list[int]]:
        """For each of ``count`` groups of classes (``group_of``: each class's group, ``NO_ID`` for none), the
        positions, ascending, of the tensors that hold any of its classes: one pass for all the groups."""
        group = group_of.index_select(0, self.classes)
        held = group != NO_ID
        n = int(self.items[-1]) + 1 if len(self.items) else 1
        pairs = torch.unique(group.masked_select(held) * n + self.items.masked_select(held))  # by group, then item
        items = (pairs % n).tolist()
        bounds = torch.bincount(pairs // n, minlength=count).cumsum(0).tolist()
        return [items[start:stop] for start, stop in zip([0] + bounds[:-1], bounds)]

    def holding(self, wanted: torch.Tensor) -> list[int]:
        """Positions, ascending, of the tensors that hold any of the classes ``wanted`` (all below the bound)."""
        mask = torch.zeros(self.bound, dtype=torch.bool)
        mask[wanted] = True
        return torch.unique_consecutive(self.items.masked_select(mask.index_select(0, self.classes))).tolist()
