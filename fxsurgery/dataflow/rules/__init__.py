"""The op table ``RULES``: one file per op family registers its labelling rules and its count-constant
hooks with ``register_rule``. Importing a family registers it; the order does not matter (an op has one rule, and a
module call takes the rule of its most derived registered class)."""
import importlib

from .base import RULES, register_rule

FAMILIES = ("sources", "linear", "elementwise", "views", "indexing", "layout", "contraction", "normalisation",
            "sizes", "opaque", "factories")
for _family in FAMILIES:
    importlib.import_module(f"{__name__}.{_family}")

__all__ = ["RULES", "register_rule"]
