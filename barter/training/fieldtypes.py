"""Values for annotated dataclass fields: text from a command line or values from a YAML/JSON file, checked
against the field's type (`int`, `float`, `bool`, `str`, `X | None`, `Literal`, a `str` Enum, `tuple`, `list`,
`dict`). An Enum's value stays its text (the name a config file holds); the consumer makes it the member.

Text is parsed the way a user writes it: "none" is None, "yes"/"no" are booleans, a dict or a sequence is
YAML flow (`{num_heads: 4}`, `[0.1, 0.4]`). A value of the wrong type raises `FieldValueError` naming the field.
"""
from __future__ import annotations

import types
import typing
from enum import Enum
from typing import Any

import yaml

NONE_WORDS = ("none", "null", "~")
BOOL_WORDS = {"true": True, "yes": True, "on": True, "1": True, "false": False, "no": False, "off": False, "0": False}


class FieldValueError(ValueError):
    """A value that does not fit its field's type; the message names the field."""


def coerce(name: str, hint: Any, value: Any) -> Any:
    """`value` (text or a parsed value) as the type `hint` of field `name`."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in NONE_WORDS and str not in inner):
            if len(inner) == len(args):
                raise FieldValueError(f"{name}: may not be None")
            return None
        return _first_fit(name, inner, value)
    if origin is typing.Literal:
        if value not in args:
            raise FieldValueError(f"{name}: must be one of {', '.join(map(repr, args))}, got {value!r}")
        return value
    if origin in (tuple, list) or hint in (tuple, list):
        return _sequence(name, origin or hint, args, value)
    if origin is dict or hint is dict:
        parsed = _yaml(name, value) if isinstance(value, str) else value
        if not isinstance(parsed, dict):
            raise FieldValueError(f"{name}: expected a mapping such as {{key: value}}, got {value!r}")
        return dict(parsed)
    return _scalar(name, hint, value)


def describe(hint: Any) -> str:
    """A short name of the type `hint` for help texts: "float", "int | none", "{key: value}"."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        inner = [describe(a) for a in args if a is not type(None)]
        return " | ".join(inner) + (" | none" if len(inner) < len(args) else "")
    if origin is dict or hint is dict:
        return "{key: value}"
    if origin in (tuple, list):
        return "[" + ", ".join(describe(a) for a in args if a is not Ellipsis) + "]"
    if isinstance(hint, type) and issubclass(hint, Enum):
        return " | ".join(str(member.value) for member in hint)
    return getattr(hint, "__name__", str(hint))


def optional_inner(hint: Any) -> Any:
    """The type `X` of `X | None` (a hint without None as it is)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(inner) == 1:
            return inner[0]
    return hint


def _first_fit(name: str, hints: list[Any], value: Any) -> Any:
    errors = []
    for hint in hints:
        try:
            return coerce(name, hint, value)
        except FieldValueError as e:
            errors.append(str(e))
    raise FieldValueError(errors[0] if len(errors) == 1 else f"{name}: {value!r} fits none of {describe(hints)}")


def _sequence(name: str, kind: type, args: tuple, value: Any) -> Any:
    items = _yaml(name, value) if isinstance(value, str) else value
    if isinstance(items, (int, float)) and not isinstance(items, bool):
        items = [items]
    if not isinstance(items, (list, tuple)):
        raise FieldValueError(f"{name}: expected a sequence such as [a, b], got {value!r}")
    if kind is tuple and args and args[-1] is not Ellipsis:
        if len(items) != len(args):
            raise FieldValueError(f"{name}: expected {len(args)} values, got {len(items)} ({value!r})")
        return tuple(coerce(name, a, v) for a, v in zip(args, items))
    item = args[0] if args else Any
    return kind(coerce(name, item, v) for v in items)


def _scalar(name: str, hint: Any, value: Any) -> Any:
    if hint is Any:
        return value
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in BOOL_WORDS:
            return BOOL_WORDS[value.lower()]
        raise FieldValueError(f"{name}: expected true or false, got {value!r}")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
        raise FieldValueError(f"{name}: expected an integer, got {value!r}")
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)  # also YAML 1.1's "1e-3", which PyYAML reads as text
            except ValueError:
                pass
        raise FieldValueError(f"{name}: expected a number, got {value!r}")
    if hint is str:
        if isinstance(value, str):
            return value
        raise FieldValueError(f"{name}: expected text, got {value!r}")
    if isinstance(hint, type) and issubclass(hint, Enum):
        names = [member.value for member in hint]
        if isinstance(value, hint) or value in names:
            return hint(value).value
        raise FieldValueError(f"{name}: must be one of {', '.join(map(repr, names))}, got {value!r}")
    if isinstance(hint, type) and not isinstance(value, hint):
        raise FieldValueError(f"{name}: expected {describe(hint)}, got {value!r}")
    return value


def _yaml(name: str, text: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise FieldValueError(f"{name}: cannot parse {text!r} ({e.__class__.__name__})") from e
