"""``UnitKind``: what a group's units are, attention heads or FFN channels."""
from __future__ import annotations

import enum


class UnitKind(str, enum.Enum):
    """The kind of a group's units. A ``str`` whose text is its value ("head", "channel"): JSON files and printed
    tables show that text, and the text read back equals the member. A checkpoint read with
    ``torch.load(weights_only=True)`` holds ``kind.value``, the plain string."""

    HEAD = "head"
    CHANNEL = "channel"

    __str__ = str.__str__
    __format__ = str.__format__

    @property
    def noun(self) -> str:
        """What one unit is, in words: "attention head" or "FFN channel"."""
        return "attention head" if self == UnitKind.HEAD else "FFN channel"
