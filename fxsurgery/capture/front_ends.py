"""Choosing the front end: symbolic tracing where it works, else the concrete-shape capture.

Symbolic tracing (``tracer``) is tried first: it is proven on the conformance lists and keeps wrapped helpers
as calls the analysis can inline. Code that it cannot trace (shape-dependent branches, type checks such as
einops', models written for ``torch.export``) is captured with the example shapes (``concrete``). Both hand
the analysis the same kind of torch-level graph; ``Recording.front_end`` says which one served and why.
"""
from __future__ import annotations

import enum
from typing import NamedTuple

import torch.fx
import torch.nn as nn

from ..errors import TraceError
from .concrete import capture
from .decompositions import NoDecomposition
from .tracer import trace


class FrontEnd(enum.Enum):
    """What records a module's graph; the value is its name in a report."""

    SYMBOLIC = "torch.fx symbolic trace"
    CONCRETE = "torch.export with the example shapes"


class FrontEndUse(NamedTuple):
    """The front end that recorded a module and why it served (``why``: the symbolic trace's failure, for the
    concrete capture); its text is the report's line, e.g. "torch.export with the example shapes (why)"."""

    front_end: FrontEnd
    why: str = ""

    def __str__(self) -> str:
        return f"{self.front_end.value} ({self.why})" if self.why else self.front_end.value


class Recording(NamedTuple):
    """A module's graph (rooted at the module), its placeholders' values, and which front end made it."""

    gm: torch.fx.GraphModule
    values: list
    front_end: FrontEndUse


def record(module: nn.Module, name: str, args: tuple, kwargs: dict, training: bool, *,
           replayed: bool = True) -> Recording:
    """Trace ``module`` symbolically, else capture it with the example inputs; a module neither front end
    can record raises ``TraceError`` naming both failures. ``replayed``: see ``concrete.capture``."""
    try:
        return Recording(*trace(module, name, args, kwargs, training), FrontEndUse(FrontEnd.SYMBOLIC))
    except TraceError as symbolic:
        if isinstance(symbolic.__cause__, NoDecomposition):
            raise
        try:
            return record_concrete(module, name, args, kwargs, training, why=_first_line(symbolic),
                                   replayed=replayed)
        except TraceError as concrete:
            raise TraceError(f"{symbolic}; {concrete}") from concrete


def record_concrete(module: nn.Module, name: str, args: tuple, kwargs: dict, training: bool, *,
                    why: str, replayed: bool = True) -> Recording:
    """The concrete-shape capture, with the reason it was used (``why``) in its front-end line."""
    gm, values = capture(module, name, args, kwargs, training, replayed=replayed)
    return Recording(gm, values, FrontEndUse(FrontEnd.CONCRETE, why))


def _first_line(error: Exception) -> str:
    text = str(error).splitlines()[0] if str(error) else type(error).__name__
    return text if len(text) <= 160 else text[:157] + "..."
