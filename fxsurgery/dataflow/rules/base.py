"""The op table of the labelling and the helpers its rules share.

A rule gets a ``Step`` (real argument values, their labels, the real output) and returns the output's
``Label`` (or a tuple of them), recording ties, pins and mixes on the way. Anything that receives ids
and has no rule pins them: the analysis never guesses.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from torch.fx.node import Node

from ..ids import NO_ID, align, broadcast, merge, pairs, unique_pairs, varies
from ..input_gathers import GatherSite, module_input
from ..labeller import Label, Step
from ..paths import module_of
from ..records import MixRead, Note
from ..rule_table import RuleTable

RULES = RuleTable()
register_rule = RULES.register  # the one way a rule enters the table, the built-in families' and a user's


def first_tensor(s: Step) -> tuple[torch.Tensor, Label | None]:
    """The first tensor argument and its label."""
    return next(iter(s.tensors()))


def wrap_dim(d: int, ndim: int) -> int:
    """``d`` as a non-negative dim of a rank-``ndim`` value."""
    return d % ndim if ndim else 0


def pin_all(s: Step, reason: str, benign: bool = False) -> None:
    """Pin the ids of every labelled tensor argument."""
    for _, lab in s.tensors():
        if lab is not None:
            s.rec.pin(lab.ids, f"{s.name}: {reason}", benign)


def defer_pins(s: Step, ids: torch.Tensor, other: Sequence[int], what: str, benign: bool = True) -> None:
    """A tensor we cannot slice lines up with ``ids``: fine unless the unit axis is one of those dims (then
    the axis is no unit axis, or, with ``benign`` False, its units are refused)."""
    ids = align(ids, max(ids.dim(), len(other)))
    other = (1,) * (ids.dim() - len(other)) + tuple(other)
    for d in range(ids.dim()):
        if ids.shape[d] > 1 and other[d] > 1:
            s.rec.pin(ids, f"{s.name}: {what} lines up with the unit axis (dim {d})", benign, d)


# a tensor with no ids beside the units: neither a parameter nor computed from one (per-head ALiBi slopes, say)
COMPUTED_TENSOR = "a tensor the code computes (no parameter or buffer), which no edit can slice,"


def held(ids: torch.Tensor, starts: list[torch.Tensor]) -> bool:
    """Whether ``ids`` begin among the fresh ids of one of ``starts`` (a fill's, made by one rule)."""
    first = int(ids.reshape(-1)[0]) if ids.numel() else NO_ID
    return any(int(u.reshape(-1)[0]) <= first <= int(u.reshape(-1)[-1]) for u in starts if u.numel())


def elementwise_labels(s: Step, operands: list[tuple[Any, Label | None]], ndim: int) -> Label | None:
    """Output label of an elementwise op over tensor ``operands`` broadcast to rank ``ndim``."""
    acts = [align(lab.ids, ndim) for _, lab in operands if lab is not None and not lab.param]
    params = [align(lab.ids, ndim) for _, lab in operands if lab is not None and lab.param]
    if not acts:  # parameters, perhaps with plain tensors (a relative-position bias plus a window mask)
        fills = [p for p in params if held(p, s.rec.broadcasts)]
        merged = [p for p in params if not held(p, s.rec.broadcasts)] or fills
        ids = merged[0]
        for p in merged[1:]:
            ids, tie = merge(ids, p)
            s.rec.tie(tie)
        for fill in (fills if merged is not fills else []):
            uniform_ties(s, fill, ids)
        for v, lab in operands:
            if lab is None and torch.is_tensor(v):
                defer_pins(s, ids, tuple(v.shape), COMPUTED_TENSOR)
        return Label(ids, True)
    ids = acts[0]
    for a in acts[1:]:
        ids, tie = merge(ids, a)
        s.rec.tie(tie)
    for p in params:
        if not uniform_ties(s, p, ids):
            s.rec.tentative.append(pairs(p, ids))
    for v, lab in operands:
        if lab is None and torch.is_tensor(v):
            gathered = input_gathers(s, ids, v)  # no pin where the units' entries are gathered
            shape = [1 if d + ids.dim() - v.dim() in gathered else n for d, n in enumerate(v.shape)]
            defer_pins(s, ids, shape, COMPUTED_TENSOR)
    return Label(ids)


def input_gathers(s: Step, ids: torch.Tensor, value: torch.Tensor) -> set[int]:
    """The dims of ``ids``, heads of attention logits, that the plain operand ``value`` lines up with (in runs, one
    entry per head: a batch dim may be merged before them) where it is an input of the module computing the logits
    (``input_gathers.module_input``): the graph is then made to read it there through a gather of the units (the
    site recorded here). None inside an opaque function."""
    node = None if s.lab.nested else s.node_of(value)
    if node is None:
        return set()
    ids = align(ids, max(ids.dim(), value.dim()))
    lead = ids.dim() - value.dim()
    dims = set()
    for d in range(lead, ids.dim()):
        heads = head_axis(s, ids, d)
        if heads is None or value.shape[d - lead] != heads.numel() or bool((heads == NO_ID).any()):
            continue
        size = int(heads.unique().numel())
        if heads.numel() % size or not torch.equal(heads, heads[:size].repeat(heads.numel() // size)):
            continue
        found = module_input(node, d - lead, module_of(s.node))
        if found is not None:
            dims.add(d)
            s.rec.gathers.append(GatherSite(found.name, module_of(s.node), d - lead, size, s.lab.shapes[found]))
    return dims


def uniform_ties(s: Step, fill: torch.Tensor, ids: torch.Tensor) -> bool:
    """Whether ``fill`` is a factory's fill of one number (``rules/factories.py``), and if so tie it to the
    coordinates ``ids`` where it lines up with them: it must follow them. Where it broadcasts along coordinates
    that vary (one fill beside every head) it is the same for each, and ties to none; where they vary along no dim
    (a layer of one head) it lines up with nothing, serves any count by broadcasting, and ties to none either (a
    mask made once would otherwise tie every layer's one head into one)."""
    if not held(fill, s.rec.uniform):
        return False
    fill, ids = align(fill, max(fill.dim(), ids.dim())), align(ids, max(fill.dim(), ids.dim()))
    lined_up = [d for d in range(ids.dim()) if varies(ids, d)]
    if lined_up and all(fill.shape[d] > 1 for d in lined_up):
        s.rec.tie(pairs(fill, ids))
    return True


def mix(s: Step, ids: torch.Tensor, dims: Sequence[int], what: str) -> None:
    """Coordinates normalised or reduced together: removing one changes the others (not exact)."""
    dims = [d for d in dims if ids.shape[d] > 1]
    if dims:
        rep = ids.amax(dim=dims, keepdim=True)
        a, b = broadcast(ids, rep)
        p = unique_pairs(torch.stack([a.flatten(), b.flatten()], 1))
        s.rec.mix(p, f"{s.name}: {what}")


def head_axis(s: Step, ids: torch.Tensor, dim: int) -> torch.Tensor | None:
    """The ids along ``dim`` where they vary along it alone and are all ids of products of two activations (q·kᵀ)
    not yet applied to values (``Records.applied``): a heads axis of attention logits or weights. None otherwise."""
    if not varies(ids, dim) or any(varies(ids, d) for d in range(ids.dim()) if d != dim):
        return None
    heads = ids.movedim(dim, 0).reshape(ids.shape[dim], -1)[:, 0]
    present = heads[heads != NO_ID]
    products, applied = ([t.flatten() for t in ts] for ts in (s.rec.products, s.rec.applied))
    if not products or not torch.isin(present, torch.cat(products)).all():
        return None
    return None if applied and torch.isin(present, torch.cat(applied)).any() else heads


def mixing_map(s: Step, name: str, heads: torch.Tensor, *, read: int, made: int, source: Node | None,
               dim: int) -> None:
    """The heads×heads parameter ``name`` mixes heads ``heads`` (talking heads): head g of its output is unit g, and
    the map is a member along both dims, ``read`` (the side that reads a head: split on a clone and masked for a
    removal, like output weights) and ``made`` (the side that makes it: copied). The heads enter the map along
    dim ``dim`` of ``source``: a tap point of the group sees them there too."""
    input_name = None if s.lab.nested or source is None else source.name
    s.rec.mix_reads.append(MixRead(s.name, input_name, dim, heads))
    for d, output in ((read, True), (made, False)):
        shape = [1, 1]
        shape[d] = heads.numel()
        s.rec.member(name, heads.reshape(shape), output)
    s.rec.notes.append(Note(heads, f"heads mixed by {name} ({s.name}): a head also owns its row and column of it (the "
                                   "side that reads the head is split on a clone, like output weights; the side "
                                   "that makes it is copied)"))


def param_label(s: Step, name: str, p: torch.Tensor) -> Label:
    """Fresh ids, one per element, for a parameter or buffer; it is a member candidate."""
    ids = s.rec.fresh(tuple(p.shape))
    s.rec.member(name, ids)
    return Label(ids, True)
