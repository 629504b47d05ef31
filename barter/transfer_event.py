"""`TransferEvent`: the record of one attempted transfer, the controller's event log entry and a line of
events.jsonl."""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields
from typing import Any

from fxsurgery import UnitKind

DELAYS = (10, 100)  # optimizer steps after a transfer at which the probe loss is measured again
ROLES = ("parent", "new", "kept")  # the units whose update sizes are watched: the parent, its twin, a kept unit
SCORE_FIELDS = ("donor_D", "receiver_R", "parent_S")  # the running scores a choice was made on
PROBE_FIELDS = ("probe_loss_before", "probe_loss_after", *(f"probe_loss_{d}" for d in DELAYS),
                *(f"update_{r}" for r in ROLES))  # what the transfer probe measures


@dataclass(eq=False)
class TransferEvent(Mapping[str, Any]):
    """One proposal of `kind` at optimizer step `step`: the units it moved (an executed transfer names the parts that
    ran; a skipped one, what it had chosen, and why in `skipped`), the running scores its choice was made on, and
    what the transfer probe measured (`barter.transfer_probe`).

    It reads as its events.jsonl record, a mapping: the probe's fields only once the probe watched it (`probed`),
    `removed_at` only for a fading donor (the step after which it goes)."""

    step: int
    kind: UnitKind
    donor_layer: str | None = None
    donor_group: str | None = None
    donor_index: int | None = None
    receiver_layer: str | None = None
    receiver_group: str | None = None
    parent_index: int | None = None
    new_index: int | None = None
    skipped: str | None = None
    donor_D: float | None = None
    receiver_R: float | None = None
    parent_S: float | None = None
    probed: bool = False
    probe_loss_before: float | None = None
    probe_loss_after: float | None = None
    probe_loss_10: float | None = None
    probe_loss_100: float | None = None
    update_parent: list[float] | None = None
    update_new: list[float] | None = None
    update_kept: list[float] | None = None
    removed_at: int | None = None

    def record(self) -> dict[str, Any]:
        """The events.jsonl record: plain values (the kind as its text), keys in the order the log has them."""
        out = {f.name: getattr(self, f.name) for f in fields(self)
               if f.name != "probed" and (self.probed or f.name not in PROBE_FIELDS)}
        out["kind"] = self.kind.value
        if self.removed_at is None:
            del out["removed_at"]
        return out

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> TransferEvent:
        """The event a `record()` (a line of events.jsonl, a checkpoint's entry) describes."""
        return cls(**{**record, "kind": UnitKind(record["kind"])}, probed="probe_loss_before" in record)

    def __getitem__(self, key: str) -> Any:
        return self.record()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.record())

    def __len__(self) -> int:
        return len(self.record())
