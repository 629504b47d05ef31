"""``Reason``: why the analysis cannot use something, as a record (the text the user reads, and where)."""
from __future__ import annotations

from typing import NamedTuple


class Reason(NamedTuple):
    """Why a host, a group or a node cannot serve: ``text`` as the report shows it, and where when known (``module``:
    a module path, ``node``: a graph node's name), so code reads the fields and never parses the text."""

    text: str
    module: str | None = None
    node: str | None = None

    def __str__(self) -> str:
        return self.text
