"""Command-line flags generated from a dataclass's fields, so every field is settable and none can drift.

Each field `some_name` becomes `--some-name VALUE` (a boolean: `--some-name` / `--no-some-name`; a tuple or
list: several values); the text is checked against the field's type by `barter.training.fieldtypes`. Flags
not given are absent from the namespace, so only what the user typed overrides a preset or a config file.
"""
from __future__ import annotations

import argparse
import typing
from typing import Any

from .fieldtypes import describe, optional_inner


def add_field_flags(parser: argparse._ActionsContainer, hints: dict[str, Any], *, helps: dict[str, str],
                    choices: dict[str, tuple[str, ...]], prefix: str = "") -> None:
    """One flag per entry of `hints` ({field: type}); its value lands in the namespace as `prefix + field`."""
    for name, hint in hints.items():
        flag = "--" + name.replace("_", "-")
        text = helps.get(name, name.replace("_", " "))
        options: dict[str, Any] = {"dest": prefix + name, "default": argparse.SUPPRESS}
        if hint is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, help=text, **options)
            continue
        inner = optional_inner(hint)
        if name in choices:
            options["choices"] = choices[name]
        elif typing.get_origin(inner) in (tuple, list):
            options.update(nargs="+", metavar=describe(typing.get_args(inner)[0]).upper())
        else:
            options["metavar"] = describe(hint).upper().replace(" ", "")
        parser.add_argument(flag, help=f"{text} [{describe(hint)}]", **options)


def field_values(args: argparse.Namespace, hints: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{field: value} of the flags given on the command line, as text (checked later, naming the field)."""
    return {name: getattr(args, prefix + name) for name in hints if hasattr(args, prefix + name)}

