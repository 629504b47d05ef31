"""Runs cut anywhere in a checkpoint write resume exactly: each cut run trains in a forked child that dies inside the
write (the tests that fork, apart from test_checkpoint_integrity.py's, so that those run in the main pass)."""
import os
from pathlib import Path

import pytest
import torch
from checkpoint_runs import assert_same_end, config

from barter.training import TrainConfig, train
from barter.training.runlog import RunDir

KILLED = 17  # the exit status of a child cut in a checkpoint write


def run_cut(cfg: TrainConfig, cut) -> None:
    """Train `cfg` in a forked child that `cut()` prepares to end with os._exit(KILLED) inside a write."""
    pid = os.fork()
    if pid == 0:
        status = 1
        try:
            cut()
            train(cfg)
        finally:
            os._exit(status)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == KILLED


def exit_at(owner, attribute: str, *, when) -> None:
    """Make `owner.attribute` end the process (before doing anything) on the call for which `when(args)`
    first counts to True."""
    real = getattr(owner, attribute)

    def cut(*args, **kwargs):
        if when(*args):
            os._exit(KILLED)
        return real(*args, **kwargs)

    setattr(owner, attribute, cut)


def nth(n: int, match):
    """A predicate true on the `n`-th call whose arguments `match`."""
    seen = []

    def when(*args):
        if match(*args):
            seen.append(1)
        return len(seen) == n

    return when


CUTS = {  # where the child dies: the owner, the function, and on which of its calls
    "writing trainer.pt": (torch, "save", nth(2, lambda obj, f, *a: Path(f).name == "trainer.pt")),
    "writing the manifest": (os, "replace", nth(3, lambda src, dst: Path(dst).name == "manifest.json")),
    "before last/ becomes previous/": (os, "replace", nth(1, lambda src, dst: Path(dst).name == "previous")),
    "between the renames (no last/)": (os, "replace", nth(2, lambda src, dst: Path(dst).name == "last")),
    "before the first best/": (os, "replace", nth(1, lambda src, dst: Path(dst).name == "best")),
    "before the metrics line": (RunDir, "append_metrics", nth(2, lambda *args: True)),
}


@pytest.mark.parametrize("point", list(CUTS))
def test_run_cut_inside_a_checkpoint_write_resumes_exactly(whole, tmp_path, point):
    owner, attribute, when = CUTS[point]
    cfg = config(tmp_path, "cut")
    run_cut(cfg, lambda: exit_at(owner, attribute, when=when))
    train(cfg, resume=True)
    assert_same_end(tmp_path / "cut", whole)
    assert not any(p.name.endswith((".tmp", ".old")) for p in (tmp_path / "cut").iterdir())
