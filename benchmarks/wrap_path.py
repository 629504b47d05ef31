"""The data path of `barter.wrap` through the project's modules, on the tiny timm ViT the tests train (depth 3,
4 heads): which modules run, in the order they first run, how often each is entered anew (a call into it while
none of its frames is on the stack; re-entries are entries after the first), and the calls across modules from
the entry points (wrap, analyse, the analysis's planning and installing, the Surgeon).

    python benchmarks/wrap_path.py

A profile hook (`sys.setprofile`) sees every Python call; frames outside `barter/` and `fxsurgery/` are not
counted, and the modules under them are counted as their callers' calls.
"""
from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from tiny_vit import build_vit  # noqa: E402

import barter  # noqa: E402

ENTRY_POINTS = ("barter/wrapping.py", "fxsurgery/analysis/value.py", "fxsurgery/analysis/model.py",
                "fxsurgery/analysis/install.py",
                "fxsurgery/surgeon.py")


class ModulePath:
    """A profile hook that records the project modules a call runs through."""

    def __init__(self) -> None:
        self.names: dict[str, str] = {}  # code file -> project module ("" outside the project)
        self.stack: list[str] = []  # the project modules of the frames on the stack
        self.entries: Counter[str] = Counter()
        self.order: list[str] = []
        self.across: Counter[tuple[str, str]] = Counter()  # (caller module, callee module) -> calls

    def module(self, code: CodeType) -> str:
        name = self.names.get(code.co_filename)
        if name is None:
            path = Path(code.co_filename).resolve() if not code.co_filename.startswith("<") else None
            inside = path is not None and path.is_file() and path.parts[len(ROOT.parts)] in ("barter", "fxsurgery") \
                and path.is_relative_to(ROOT)
            name = self.names[code.co_filename] = path.relative_to(ROOT).as_posix() if inside else ""
        return name

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event not in ("call", "return"):
            return
        name = self.module(frame.f_code)
        if not name:
            return
        if event == "return":
            self.stack.pop()
            return
        if self.stack and self.stack[-1] != name:
            self.across[self.stack[-1], name] += 1
        if name not in self.stack:
            self.entries[name] += 1
            if name not in self.order:
                self.order.append(name)
        self.stack.append(name)


def main() -> None:
    model = build_vit()
    path = ModulePath()
    sys.setprofile(path)
    try:
        barter.wrap(model, total_steps=10, density=0.5)
    finally:
        sys.setprofile(None)
    by_package = Counter(name.rpartition("/")[0] for name in path.order)
    print(f"modules: {len(path.order)} ({', '.join(f'{p}/: {n}' for p, n in sorted(by_package.items()))})")
    print(f"entries: {sum(path.entries.values())}, re-entries: {sum(path.entries.values()) - len(path.order)}")
    print("re-entries by module, in the order the modules first run:")
    for name in path.order:
        print(f"  {path.entries[name] - 1:5d}  {name}")
    print("calls across modules from the entry points:")
    for (caller, callee), calls in sorted(path.across.items(),
                                          key=lambda e: (path.order.index(e[0][0]), path.order.index(e[0][1]))):
        if caller in ENTRY_POINTS:
            print(f"  {caller} -> {callee}: {calls}")


if __name__ == "__main__":
    main()
