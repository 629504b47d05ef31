"""What labelling a graph learns, in terms of ids: one NamedTuple per kind of fact, kept in ``Records``."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch.fx.node import Node

from .input_gathers import GatherSite


class Pin(NamedTuple):
    """Coordinates that cannot be sliced. ``benign``: they simply are no unit axis (residual stream,
    model output). ``dim`` set: only if the unit axis turns out to be that dim."""

    ids: torch.Tensor
    reason: str
    benign: bool = False
    dim: int | None = None
    at_output: bool = False  # the graph returns them: benign for the residual stream, not for heads


class Mix(NamedTuple):
    """(k, 2) id pairs normalised or reduced together: removing one coordinate changes the others."""

    pairs: torch.Tensor
    reason: str


class Space(NamedTuple):
    """The ids ``start`` to ``stop`` a linear map (graph node ``node``) gave its output features."""

    start: int
    stop: int
    node: str


class Member(NamedTuple):
    """Ids (broadcastable to the parameter or buffer ``name``) naming the coordinates of its elements. ``output``:
    its elements read the units into other units (a head-mixing map's read side), split on a clone like the
    output projection's columns."""

    name: str
    ids: torch.Tensor
    output: bool = False


class Sink(NamedTuple):
    """A linear map (graph node ``node``) reading coordinates ``columns`` with its weight's columns, over
    feature dim ``dim`` of its input (graph node ``input``: where a tap sees the units)."""

    weight: str
    node: str
    columns: torch.Tensor
    dim: int
    weight_dim: int = 1  # the weight dim that meets the input features (0 for a weight stored [in, out])
    input: str | None = None  # None where the input is no node of the labelled graph (inside an opaque call)


class TapLayout(NamedTuple):
    """Where a tap sees a group's units: along ``dim`` of a value whose features are laid out
    ``[outer][unit][inner]`` there."""

    outer: int
    inner: int
    dim: int


class MixRead(NamedTuple):
    """A head-mixing map (graph node ``node``) reading heads ``heads`` along dim ``dim`` of its input (graph node
    ``input``: where a tap sees the heads enter the map; None inside an opaque call)."""

    node: str
    input: str | None
    dim: int
    heads: torch.Tensor


class SharedRead(NamedTuple):
    """A value (graph node ``node``; None inside an opaque call) that the units along its dim ``dim`` read alike
    where contraction ``at`` meets them (one key/value head repeated to every query head): it carries none of their
    coordinates, yet its size along ``dim`` follows their count. ``units``: the ids of the operand that holds them."""

    at: str
    node: Node | None
    dim: int
    units: torch.Tensor


class NonEmpty(NamedTuple):
    """Coordinates an op cannot have zero of."""

    ids: torch.Tensor
    reason: str


class Act(NamedTuple):
    """A labelled value: output ``index`` of ``node`` (None for a single output) and its ids."""

    node: Node
    index: int | None
    ids: torch.Tensor
    param: bool


class Opaque(NamedTuple):
    """A call that takes parameters and has no rule: whatever units it holds are not analysed."""

    node: Node
    reason: str


class Weighing(NamedTuple):
    """A softmax over dim ``dim`` (of ``size`` positions) of a value whose ids are ``ids``."""

    node: Node
    ids: torch.Tensor
    dim: int
    size: int


class Note(NamedTuple):
    """What a unit of the group holding ``ids`` is, when it is more than one head or one channel."""

    ids: torch.Tensor
    text: str


@dataclass
class Records:
    """Everything the labelling learns; ``next_id`` is the number of ids handed out."""

    next_id: int = 0
    ties: list[torch.Tensor] = field(default_factory=list)  # (k, 2) id pairs of one unit
    tentative: list[torch.Tensor] = field(default_factory=list)  # (param id, activation id) uses
    mixes: list[Mix] = field(default_factory=list)
    pins: list[Pin] = field(default_factory=list)
    contracted: list[torch.Tensor] = field(default_factory=list)  # ids contracted against activations
    spaces: list[Space] = field(default_factory=list)
    members: list[Member] = field(default_factory=list)
    sinks: list[Sink] = field(default_factory=list)
    mix_reads: list[MixRead] = field(default_factory=list)
    nonempty: list[NonEmpty] = field(default_factory=list)
    acts: list[Act] = field(default_factory=list)
    size_reads: set[Node] = field(default_factory=set)
    opaque: list[Opaque] = field(default_factory=list)
    # products with a parameter whose own dims make the output's but that are no linear map of the input's features
    # (a weight computed from parameters): they start no unit space, which is told where their module ends with no
    # group
    unstarted: list[Opaque] = field(default_factory=list)
    notes: list[Note] = field(default_factory=list)
    products: list[torch.Tensor] = field(default_factory=list)  # ids of products of two activations (q·kᵀ)
    # ids of products of two activations that contract no coordinates (weights applied to values, attn·V): a
    # map over those heads past this point is their output projection, not a mixing of their weights
    applied: list[torch.Tensor] = field(default_factory=list)
    softmaxes: list[Weighing] = field(default_factory=list)
    shared_reads: list[SharedRead] = field(default_factory=list)
    # ids of values a factory filled with one number (``torch.zeros``): slicing one is rewriting its size
    uniform: list[torch.Tensor] = field(default_factory=list)
    # ids of plain tensors an ``expand`` broadcast along new dims (also in ``uniform``): beside parameters alone they
    # tie to them as a factory's fill does, not merged
    broadcasts: list[torch.Tensor] = field(default_factory=list)
    # inputs of a module computing attention logits that line up with their heads, computed at the analysed count:
    # the graph is made to read them through a gather of the units (``input_gathers``)
    gathers: list[GatherSite] = field(default_factory=list)

    def fresh(self, shape: tuple[int, ...]) -> torch.Tensor:
        n = 1
        for s in shape:
            n *= s
        out = torch.arange(self.next_id, self.next_id + n).reshape(shape)
        self.next_id += n
        return out

    def tie(self, p: torch.Tensor) -> None:
        if p.numel():
            self.ties.append(p)

    def member(self, name: str, ids: torch.Tensor, output: bool = False) -> None:
        """A weight is listed once for its rows and once for its columns."""
        self.members.append(Member(name, ids, output))

    def pin(self, ids: torch.Tensor, reason: str, benign: bool = False, dim: int | None = None,
            at_output: bool = False) -> None:
        self.pins.append(Pin(ids, reason, benign, dim, at_output))

    def mix(self, pairs: torch.Tensor, reason: str) -> None:
        self.mixes.append(Mix(pairs, reason))
