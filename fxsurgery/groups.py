"""Unit groups: what the analysis found of each (``GroupDescription``, immutable), the live state a Surgeon's edits
change (``GroupState``), the view of both users operate on (``UnitGroup``), ``LeftOut``, and the plumbing the engine
keeps per installed group."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, NamedTuple

from .dataflow.constants import ConstantSpec
from .dataflow.records import TapLayout
from .slicing import ParamSlice
from .unit_kind import UnitKind


@dataclass(frozen=True, kw_only=True)
class GroupDescription:
    """What the analysis found of one group of interchangeable units (attention heads or FFN channels) of one layer:
    immutable, and what an ``Analysis`` holds. ``max_count`` is the count in the model as analysed (``count`` reads
    it too); ``exact`` is True when clone and remove are function-preserving; ``slices`` are as analysed."""

    name: str
    kind: UnitKind
    module: str
    max_count: int
    exact: bool
    slices: tuple[ParamSlice, ...]
    notes: tuple[str, ...] = ()
    min_count: int = 0

    @property
    def count(self) -> int:
        """The count as analysed (a Surgeon's ``UnitGroup`` reads its live count instead)."""
        return self.max_count

    def to_dict(self) -> dict[str, Any]:
        """The description as plain JSON values (``from_dict`` reads it back)."""
        return {"name": self.name, "kind": self.kind.value, "module": self.module, "max_count": self.max_count,
                "exact": self.exact, "slices": [dataclasses.asdict(sl) for sl in self.slices],
                "notes": list(self.notes), "min_count": self.min_count}

    @classmethod
    def from_dict(cls, record: dict[str, Any]) -> GroupDescription:
        """The description ``to_dict`` wrote (other keys of ``record`` are ignored)."""
        return cls(name=record["name"], kind=UnitKind(record["kind"]), module=record["module"],
                   max_count=record["max_count"], exact=record["exact"],
                   slices=tuple(ParamSlice(**sl) for sl in record["slices"]), notes=tuple(record["notes"]),
                   min_count=record["min_count"])


@dataclass
class GroupState:
    """The live state of one installed group, which only its Surgeon's edits change: the count, and the slices (a
    segment of a fused projection moves with the counts of the groups before it)."""

    count: int
    slices: tuple[ParamSlice, ...]

    @classmethod
    def as_analysed(cls, description: GroupDescription) -> GroupState:
        return cls(description.max_count, description.slices)


class UnitGroup:
    """A group as a Surgeon operates on it: its ``description`` (what the analysis found: ``name``, ``kind``,
    ``module``, ``max_count``, ``min_count``, ``exact``, ``notes``) and its live state (``count``, ``slices``),
    which only the Surgeon's edits change (``editing.Editor.settle``). Read-only to everyone else."""

    description: GroupDescription
    name: str  # the description's fields, read as plain attributes
    kind: UnitKind
    module: str
    max_count: int
    min_count: int
    exact: bool
    notes: tuple[str, ...]
    _state: GroupState

    def __init__(self, description: GroupDescription):
        fields = {f: getattr(description, f) for f in ("name", "kind", "module", "max_count", "min_count", "exact",
                                                       "notes")}
        vars(self).update(fields, description=description, _state=GroupState.as_analysed(description))

    count = property(lambda self: self._state.count, doc="The count now.")
    slices = property(lambda self: self._state.slices, doc="The slices now.")

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"{self.name}: a unit group is read-only ({name}); its Surgeon's edits change its count")

    def __repr__(self) -> str:
        return f"UnitGroup({self.name!r}, {self.kind}, {self.count}/{self.max_count}, exact={self.exact})"


@dataclass
class LeftOut:
    """A part of the model the analysis did not turn into a group, and why."""

    module: str
    reasons: list[str]


class ConstantSlot(NamedTuple):
    """A host attribute that holds ``per_unit`` × the count (a rewritten graph constant)."""

    attr: str
    per_unit: int


@dataclass(frozen=True, kw_only=True)
class GroupPlumbing:
    """One group as installed in its host, what the engine needs of it: the edits (its host, the slots that hold
    its count constants, its tap point) and the serving of its host's other calls (``runtime.own_forward``,
    ``runtime.recapture``: its sink, kind, counts and slices in the host's template, where the units lie at the
    tap). Its ``sink`` and ``slices`` are named within the host."""

    host: str
    sink: str  # the output projection's weight
    kind: UnitKind
    max_count: int  # the count in the host's template
    min_count: int
    exact: bool  # as analysed: a removal equals masking (a group with a reduction over its units does not)
    slices: tuple[ParamSlice, ...]  # as in the template
    constants: list[ConstantSpec]  # the graph constants that follow the count
    slots: list[ConstantSlot]  # the host attributes that hold them: a graph captured for another call adds to them
    tap_point: str  # the host attribute holding the tap point
    tap_layout: TapLayout  # the units in the output projection's input
