"""The README as written: each ```python block runs as a script in a fresh process; each command line of the
```bash blocks uses flags the `barter` parser takes and targets the Makefile has; docs/architecture.md (and the
README's links) cite only files, tests and project names that exist.

The python blocks train tiny models for a few steps: most of their time goes to importing torch and the
frameworks (about 5 to 9 seconds of CPU a block).
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import io
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
from forked import free_ports

from barter.training.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
BLOCK_TIMEOUT_S = 300  # each block takes seconds; minutes only on a machine that is busy with much else
EXTRAS = {"lightning": "lightning", "transformers": "hf"}  # optional module a block imports -> the extra with it


class Block(NamedTuple):
    """A fenced code block: the heading it sits under, its language, its text and its first line in the file."""

    heading: str
    language: str
    source: str
    line: int


def fenced_blocks(path: Path, language: str) -> list[Block]:
    """The ```language blocks of a markdown file, in order. A line in a block that starts with # (a comment) is no
    heading."""
    lines = path.read_text().splitlines()
    heading, found, k = "", [], 0
    while k < len(lines):
        if lines[k].startswith("```"):
            fence_language, start = lines[k][3:].strip(), k + 1
            k = start
            while not lines[k].startswith("```"):
                k += 1
            if fence_language == language:
                found.append(Block(heading, fence_language, "\n".join(lines[start:k]) + "\n", start + 1))
        elif lines[k].startswith("#"):
            heading = lines[k].lstrip("#").strip()
        k += 1
    return found


def block_ids(blocks: list[Block]) -> list[str]:
    """Each block's heading as a test id (a number appended to the second block under one heading, and so on)."""
    ids: list[str] = []
    for b in blocks:
        slug = re.sub(r"[^a-z0-9]+", "-", b.heading.lower()).strip("-") or "top"
        repeats = sum(i == slug or i.startswith(slug + "-") for i in ids)
        ids.append(f"{slug}-{repeats + 1}" if repeats else slug)
    return ids


PYTHON_BLOCKS = fenced_blocks(README, "python")
BASH_BLOCKS = fenced_blocks(README, "bash")


def missing_extra(block: Block) -> str | None:
    """Why the block cannot run here: it imports a framework whose extra is not installed (else None)."""
    for module in re.findall(r"^(?:from|import)\s+(\w+)", block.source, re.MULTILINE):
        if module in EXTRAS and importlib.util.find_spec(module) is None:
            return f"needs the {EXTRAS[module]} extra: pip install -e \".[{EXTRAS[module]}]\""
    return None


def launcher_environment(block: Block) -> dict[str, str]:
    """What torchrun sets for a process, making a one-process world, for a block that starts a process group."""
    if "init_process_group" not in block.source:
        return {}
    return {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_ports(1)[0])}


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=block_ids(PYTHON_BLOCKS))
def test_python_block(block: Block, tmp_path: Path) -> None:
    """The block runs as a script in an empty directory. One intra-op thread, as tests/conftest.py sets for the
    suite: the models are tiny, and more threads only contend with other processes for the cores."""
    reason = missing_extra(block)
    if reason is not None:
        pytest.skip(reason)
    (tmp_path / "readme_block.py").write_text(block.source)
    env = {**os.environ, "OMP_NUM_THREADS": "1", **launcher_environment(block)}
    where = f"README.md line {block.line} (under '{block.heading}')"
    try:
        done = subprocess.run([sys.executable, "readme_block.py"], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=BLOCK_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{where} ran past {BLOCK_TIMEOUT_S}s; its output:\n{e.stdout or ''}{e.stderr or ''}")
    assert done.returncode == 0, f"{where} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"


class CommandLine(NamedTuple):
    """A command line of a bash block: the heading it sits under, its text, and its words as a shell splits them."""

    heading: str
    text: str
    words: list[str]


def command_lines(blocks: list[Block]) -> list[CommandLine]:
    """The command lines of bash blocks, split as a shell splits them, with the comments dropped."""
    return [CommandLine(b.heading, line.strip(), shlex.split(line, comments=True))
            for b in blocks for line in b.source.splitlines() if shlex.split(line, comments=True)]


def barter_arguments(words: list[str]) -> list[str] | None:
    """The arguments a command line hands the `barter` command (`barter`, `.venv/bin/barter`,
    `python -m barter`, `torchrun ... -m barter`), or None if it does not run it."""
    if Path(words[0]).name == "barter":
        return words[1:]
    if Path(words[0]).name in ("python", "python3", "torchrun") and "-m" in words[:-1]:
        module = words.index("-m") + 1
        if words[module] == "barter":
            return words[module + 1:]
    return None


def parse_barter(arguments: list[str]) -> tuple[int, str]:
    """Parse `barter`'s arguments with its own parser, running nothing: the exit status (0 also for `--help`) and
    what the parser printed."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
        try:
            build_parser().parse_args(arguments)
        except SystemExit as exit_:
            return exit_.code or 0, printed.getvalue()
    return 0, printed.getvalue()


def make_targets() -> set[str]:
    """The targets the Makefile defines."""
    return set(re.findall(r"^([\w.-]+)\s*:(?!=)", (ROOT / "Makefile").read_text(), re.MULTILINE))


COMMANDS = command_lines(BASH_BLOCKS)
BARTER_COMMANDS = [c for c in COMMANDS if barter_arguments(c.words) is not None]
MAKE_COMMANDS = [c for c in COMMANDS if c.words[0] == "make"]


def test_the_readme_has_blocks_of_every_kind_checked() -> None:
    """Guards the extraction: a README whose blocks it no longer found would pass every test below."""
    assert PYTHON_BLOCKS and BARTER_COMMANDS and MAKE_COMMANDS


@pytest.mark.parametrize("command", BARTER_COMMANDS, ids=[" ".join(c.words) for c in BARTER_COMMANDS])
def test_barter_command_line_parses(command: CommandLine) -> None:
    status, printed = parse_barter(barter_arguments(command.words))
    assert status == 0, f"README (under '{command.heading}'): `{command.text}` does not parse:\n{printed}"


def test_a_flag_barter_does_not_have_is_caught() -> None:
    status, printed = parse_barter(barter_arguments(shlex.split("torchrun --nproc_per_node=2 -m barter train "
                                                                "--no-such-flag 3")))
    assert status == 2 and "--no-such-flag" in printed


@pytest.mark.parametrize("command", MAKE_COMMANDS, ids=[" ".join(c.words) for c in MAKE_COMMANDS])
def test_make_command_names_targets_of_the_makefile(command: CommandLine) -> None:
    targets = [w for w in command.words[1:] if not w.startswith("-") and "=" not in w]
    assert targets and set(targets) <= make_targets(), f"`{command.text}`: the Makefile has {sorted(make_targets())}"


def resolves(dotted: str) -> bool:
    """Whether a dotted name is a project module, or an attribute path inside one."""
    parts = dotted.split(".")
    for k in range(len(parts), 0, -1):
        module = ".".join(parts[:k])
        try:
            found = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name is not None and module.startswith(e.name):  # no such module: a shorter prefix may be one
                continue
            raise
        for attribute in parts[k:]:
            if not hasattr(found, attribute):
                return False
            found = getattr(found, attribute)
        return True
    return False


def defines(path: Path, name: str) -> bool:
    """Whether the file defines a function or class ``name`` (at any indentation)."""
    pattern = rf"^\s*(?:async\s+)?(?:def|class)\s+{re.escape(name)}\b"
    return re.search(pattern, path.read_text(), re.MULTILINE) is not None


def missing_citations(markdown: str) -> list[str]:
    """The code spans of `markdown` (outside fenced blocks) that cite what does not exist: a path from the project
    root (`fxsurgery/surgeon.py`, `tests/`), a test or class in a file (`tests/x.py::test_y`), or a project name
    (`fxsurgery.analyse`, `barter.method.TrainingMethod`)."""
    prose = re.sub(r"^```.*?^```", "", markdown, flags=re.MULTILINE | re.DOTALL)
    missing = []
    for span in re.findall(r"`([^`\n]+)`", prose):
        cited = re.fullmatch(r"([\w.-]+(?:/[\w.-]+)*/?)(?:::(\w+))?", span)
        if cited and "/" in cited[1]:
            path = ROOT / cited[1]
            if not path.exists() or (cited[2] and not defines(path, cited[2])):
                missing.append(span)
        elif re.fullmatch(r"(?:fxsurgery|barter)(?:\.\w+)+", span) and not resolves(span):
            missing.append(span)
    return missing


def test_the_architecture_page_cites_what_exists() -> None:
    assert missing_citations(ARCHITECTURE.read_text()) == []


def test_a_citation_of_what_does_not_exist_is_caught() -> None:
    text = ("`fxsurgery/surgeon.py` `fxsurgery/no_such_file.py` `tests/test_readme.py::test_no_such_test` "
            "`fxsurgery.Surgeon.remove` `fxsurgery.no_such_name` `barter.wrap` `barter.no_such_module.name`")
    assert missing_citations(text) == ["fxsurgery/no_such_file.py", "tests/test_readme.py::test_no_such_test",
                                       "fxsurgery.no_such_name", "barter.no_such_module.name"]


@pytest.mark.parametrize("page", [README, ARCHITECTURE], ids=["README", "architecture"])
def test_relative_links_resolve(page: Path) -> None:
    links = [t for t in re.findall(r"\]\(([^)\s]+)\)", page.read_text()) if not re.match(r"[a-z]+:|#", t)]
    assert [t for t in links if not (page.parent / t.split("#")[0]).exists()] == []


def test_the_self_checks_tolerances_are_those_the_readme_gives() -> None:
    import torch

    from fxsurgery.analysis.verify import _TOLERANCE

    text = " ".join(README.read_text().split())
    stated = re.search(r"self-check accepts a relative difference of (\S+) in float64, (\S+) in float32, (\S+) in "
                       r"float16 and (\S+) in bfloat16", text)
    assert stated, "the README no longer gives the self-check's tolerances"
    dtypes = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
    assert {dtype: float(value.rstrip(").,")) for dtype, value in zip(dtypes, stated.groups())} == _TOLERANCE
