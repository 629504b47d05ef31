"""A package's public names imported from their modules on first use (PEP 562), so that importing the package
(as the `barter` command does before it parses its arguments) does not import torch."""
from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any


def lazy_names(package: str, sources: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The `__getattr__` and `__dir__` of `package` that give each name of `sources` ({name: submodule}) from its
    submodule, imported when the name is first read and then kept as an ordinary attribute."""

    def __getattr__(name: str) -> Any:
        if name not in sources:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{sources[name]}"), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *sources})

    return __getattr__, __dir__
