"""The run that the checkpoint tests train, cut, damage and resume (a tiny CCT trained two epochs under BARTER), and
what a resumed run must end equal to."""
from pathlib import Path

import torch

import barter
from barter.training import TrainConfig
from barter.training.runlog import RunDir, load_checkpoint


def config(out_dir, name, **kw) -> TrainConfig:
    """Two epochs of 2 steps of a tiny CCT under BARTER (transfers in both epochs), no progress output."""
    base = {"dataset": "fake", "fake_size": 32, "batch_size": 16, "epochs": 2, "lr": 2e-3, "warmup_epochs": 0.5,
            "device": "cpu", "out_dir": str(out_dir), "progress": False, "density": 0.5, "method": "barter",
            "model": "cct_2_3x1_32_tiny", "img_size": 16, "barter_options": {"window": (0.1, 0.9)}}
    return TrainConfig(**{**base, "name": name, **kw})


def assert_same_end(run: Path, reference: Path) -> None:
    """Same weights, optimizer state, transfers, FLOPs and metrics (but the wall time), and the same best model."""
    a, b = load_checkpoint(run / "last"), load_checkpoint(reference / "last")
    assert a["step"] == b["step"] and a["finished"] and a["flops"] == b["flops"]
    assert a["controller"]["events"] == b["controller"]["events"]
    for key, tensor in b["model"].items():
        assert torch.equal(a["model"][key], tensor), key
    for key, state in b["optimizer"]["state"].items():
        assert all(torch.equal(a["optimizer"]["state"][key][k], v) for k, v in state.items())
    strip = [{k: v for k, v in m.items() if k != "wall_s"} for m in RunDir(reference).metrics()]
    assert [{k: v for k, v in m.items() if k != "wall_s"} for m in RunDir(run).metrics()] == strip
    assert (run / "events.jsonl").read_text() == (reference / "events.jsonl").read_text()
    best, reference_best = barter.load(run / "best").state_dict(), barter.load(reference / "best").state_dict()
    assert all(torch.equal(best[k], v) for k, v in reference_best.items())
