"""The `barter` command's argument parser: an unknown flag is refused by the (sub)command that was given it, with
the known flags closest to it (`barter train --dnsity 0.5`: did you mean --density?).

argparse suggests only mistyped choices and command names, and only from Python 3.14 (`suggest_on_error`, turned
on here where it exists); the flags' suggestions are difflib's close matches on every Python.
"""
from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Sequence
from typing import Any

CUTOFF = 0.7  # difflib similarity a flag needs to be suggested (its default 0.6 offers --init for --dnsity)


class CommandParser(argparse.ArgumentParser):
    """ArgumentParser whose unrecognized arguments are an error of the parser that saw them, naming close flags.

    A sub-command's parser is of the same class (argparse's default), so `barter train --dnsity` shows
    `barter train`'s usage rather than the top-level one."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if sys.version_info >= (3, 14):
            kwargs.setdefault("suggest_on_error", True)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args: Sequence[str] | None = None,
                         namespace: argparse.Namespace | None = None) -> tuple[argparse.Namespace, list[str]]:
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(unrecognized(extras, self._option_string_actions, self.prefix_chars))
        return namespace, extras


def unrecognized(extras: list[str], known: Sequence[str], prefix_chars: str = "-") -> str:
    """The message for the unrecognized `extras`: each one that looks like a flag with the `known` flags closest
    to it (difflib, compared without the leading dashes)."""
    lines = [f"unrecognized arguments: {' '.join(extras)}"]
    by_name = {flag.lstrip(prefix_chars): flag for flag in known if flag.startswith(prefix_chars[0] * 2)}
    for extra in extras:
        if not extra.startswith(prefix_chars[0]) or len(extra) < 2:
            continue
        typed = extra.split("=", 1)[0]
        close = difflib.get_close_matches(typed.lstrip(prefix_chars), list(by_name), n=3, cutoff=CUTOFF)
        if close:
            flags = [by_name[name] for name in close]
            choice = flags[0] if len(flags) == 1 else f"{', '.join(flags[:-1])} or {flags[-1]}"
            lines.append(f"  {typed}: did you mean {choice}?")
    return "\n".join(lines)
