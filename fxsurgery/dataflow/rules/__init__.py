"""The op table ``RULES``: one file per op family registers its labelling rules and its count-constant
hooks. Importing a family registers it; modules are matched in registration order, so it is fixed here."""
import importlib

from .base import RULES

FAMILIES = ("sources", "linear", "elementwise", "views", "indexing", "layout", "contraction", "normalisation",
            "sizes", "opaque")
for _family in FAMILIES:
    importlib.import_module(f"{__name__}.{_family}")

__all__ = ["RULES"]
