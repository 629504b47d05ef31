"""Training runs cut by a crash in an evaluation and resumed from their last checkpoint (the resume tests)."""
from pathlib import Path

import pytest

import barter.training.loop as loop_module
from barter.training import TrainConfig, train
from barter.training.runlog import load_checkpoint


def cut_and_resume(monkeypatch: pytest.MonkeyPatch, cut: TrainConfig, *, crash_at: int):
    """Train ``cut``, crashing in its ``crash_at``-th evaluation (after the epoch-1 checkpoint), then resume."""
    real_evaluate, calls = loop_module.evaluate, []

    def crashing(*args, **kwargs):
        calls.append(1)
        if len(calls) == crash_at:
            raise KeyboardInterrupt
        return real_evaluate(*args, **kwargs)

    monkeypatch.setattr(loop_module, "evaluate", crashing)
    with pytest.raises(KeyboardInterrupt):
        train(cut)
    monkeypatch.setattr(loop_module, "evaluate", real_evaluate)
    assert load_checkpoint(Path(cut.out_dir) / cut.name / "last")["epoch"] == 1
    return train(cut, resume=True)
