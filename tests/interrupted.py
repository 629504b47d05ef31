"""Training runs cut by a crash and resumed from their last checkpoint (the resume tests)."""
import os
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


def cut_at_second_epoch_and_resume(cut: TrainConfig, ports: list[int]):
    """In a process of a torchrun-like world (its MASTER_PORT one of ``ports`` per run): train ``cut``, stopped at
    the start of its second epoch (after the epoch-1 checkpoint), then resume it."""
    real_epoch = loop_module.train_epoch

    def cut_at_second_epoch(session, *args):
        if session.epoch >= 1:
            raise KeyboardInterrupt
        return real_epoch(session, *args)

    loop_module.train_epoch = cut_at_second_epoch
    os.environ["MASTER_PORT"] = str(ports[0])
    try:
        with pytest.raises(KeyboardInterrupt):
            train(cut)
    finally:
        loop_module.train_epoch = real_epoch
    os.environ["MASTER_PORT"] = str(ports[1])
    return train(cut, resume=True)
