"""Unit groups as users see them (``UnitGroup``, ``LeftOut``), and the plumbing the engine keeps per group."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from .dataflow.constants import ConstantSpec
from .slicing import ParamSlice
from .unit_kind import UnitKind


class UnitGroup:
    """Interchangeable units (attention heads or FFN channels) of one layer, operated on together.

    ``count`` is always current; ``max_count`` is the count in the model as analysed. ``exact`` is
    True when clone and remove are function-preserving for this group.

    Read-only: what the analysis found (its notes and ``min_count`` included) is decided before the group is built,
    and only its live state, ``count`` and ``slices`` (a segment of a fused projection moves with the counts of the
    groups before it), changes, by its Surgeon's edits (``set_count``, ``set_slices``). An ``Analysis`` keeps its
    groups as analysed: a Surgeon operates on groups of its own."""

    name: str
    kind: UnitKind
    module: str
    max_count: int
    min_count: int
    exact: bool
    notes: tuple[str, ...]
    slices: tuple[ParamSlice, ...]  # live
    _count: int  # live

    def __init__(self, *, name: str, kind: UnitKind, module: str, count: int, max_count: int, exact: bool,
                 slices: tuple[ParamSlice, ...], notes: tuple[str, ...] = (), min_count: int = 0):
        vars(self).update(name=name, kind=kind, module=module, _count=count, max_count=max_count,
                          min_count=min_count, exact=exact, slices=slices, notes=notes)

    @property
    def count(self) -> int:
        return self._count

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"{self.name}: a unit group is read-only ({name}); its Surgeon's edits change its count")

    def __repr__(self) -> str:
        return f"UnitGroup({self.name!r}, {self.kind}, {self.count}/{self.max_count}, exact={self.exact})"


def set_count(group: UnitGroup, count: int) -> None:
    """The engine's write of a group's count (users read ``count`` only)."""
    vars(group)["_count"] = count


def set_slices(group: UnitGroup, slices: tuple[ParamSlice, ...]) -> None:
    """The engine's write of a group's slices (a segment of a fused projection moved by another group's edit)."""
    vars(group)["slices"] = slices


@dataclass
class LeftOut:
    """A part of the model the analysis did not turn into a group, and why."""

    module: str
    reasons: list[str]


class ConstantSlot(NamedTuple):
    """A host attribute that holds ``per_unit`` × the count (a rewritten graph constant)."""

    attr: str
    per_unit: int


@dataclass(kw_only=True)
class GroupPlumbing:
    """What the engine needs to operate on one group: its host module (whose graph it rewrites), the host
    attribute holding its tap point, its output projection's weight (whose input the tap sees), the graph
    constants that follow the count, and their slots."""

    host: str
    tap_point: str
    sink: str
    constants: list[ConstantSpec]
    slots: list[ConstantSlot] = field(default_factory=list)
