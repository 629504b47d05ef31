"""Checkpoints that cannot silently poison a run: every file checked against the manifest, a fallback to the
previous checkpoint, runs cut anywhere in a checkpoint write, damaged run logs, and the integrations' states."""
import os
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import barter
from barter.integrations.hf import read_state
from barter.integrations.lightning import controller_state
from barter.serialization import ExportError, pack_state
from barter.training import TrainConfig, train
from barter.training.cli import main
from barter.training.runlog import CheckpointError, RunDir, load_checkpoint

FILES = ("manifest.json", "model.safetensors", "topology.json", "trainer.pt", "model.pt2")
KILLED = 17  # the exit status of a child cut in a checkpoint write


def config(out_dir, name, **kw) -> TrainConfig:
    """Two epochs of 2 steps of a tiny CCT under BARTER (transfers in both epochs), no progress output."""
    base = {"dataset": "fake", "fake_size": 32, "batch_size": 16, "epochs": 2, "lr": 2e-3, "warmup_epochs": 0.5,
            "device": "cpu", "out_dir": str(out_dir), "progress": False, "density": 0.5, "method": "barter",
            "model": "cct_2_3x1_32_tiny", "img_size": 16, "barter_options": {"window": (0.1, 0.9)}}
    return TrainConfig(**{**base, "name": name, **kw})


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread, as in a forked child, so that runs cut in a child repeat the reference bit for bit."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """The uninterrupted reference run."""
    torch.set_num_threads(1)
    return train(config(tmp_path_factory.mktemp("whole"), "whole")).run_dir


def damage(file: Path, fault: str) -> None:
    data = file.read_bytes()
    if fault == "flip":
        middle = len(data) // 2
        file.write_bytes(data[:middle] + bytes(b ^ 0xFF for b in data[middle:middle + 64]) + data[middle + 64:])
    elif fault == "truncate":
        file.write_bytes(data[:len(data) // 2])
    else:
        file.unlink()


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


@pytest.mark.parametrize("fault", ["flip", "truncate", "delete"])
@pytest.mark.parametrize("name", FILES)
def test_damaged_last_checkpoint_falls_back_to_the_previous(whole, tmp_path, name, fault):
    """Any file of last/ damaged: the resume warns naming it, trains again from previous/ and ends as the
    uninterrupted run."""
    run = shutil.copytree(whole, tmp_path / "run")
    damage(run / "last" / name, fault)
    with pytest.warns(UserWarning, match=f"last.*{name}.*resuming from the previous checkpoint"):
        train(config(tmp_path, "run"), resume=True)
    assert_same_end(run, whole)
    assert sorted(p.name for p in run.iterdir() if p.is_dir() and p.name != "tensorboard") == [
        "best", "last", "previous"]


@pytest.mark.parametrize("fault", ["flip", "truncate", "delete"])
@pytest.mark.parametrize("name", FILES)
def test_damaged_only_checkpoint_is_a_clear_error(whole, tmp_path, name, fault):
    """Without a previous checkpoint to fall back on, resuming names the damaged file."""
    run = shutil.copytree(whole, tmp_path / "run")
    shutil.rmtree(run / "previous")
    damage(run / "last" / name, fault)
    with pytest.raises(CheckpointError, match=f"last.*{name}"):
        train(config(tmp_path, "run"), resume=True)


def test_both_checkpoints_damaged_names_both(whole, tmp_path):
    run = shutil.copytree(whole, tmp_path / "run")
    damage(run / "last" / "trainer.pt", "flip")
    damage(run / "previous" / "model.safetensors", "truncate")
    with pytest.raises(CheckpointError, match=r"last.*trainer\.pt.*previous.*model\.safetensors"):
        train(config(tmp_path, "run"), resume=True)


@pytest.mark.parametrize("name", ["model.safetensors", "topology.json", "manifest.json"])
def test_load_eval_and_export_name_the_damaged_file(whole, tmp_path, capsys, name):
    run = shutil.copytree(whole, tmp_path / "run")
    damage(run / "best" / name, "flip")
    with pytest.raises(ExportError, match=name):
        barter.load(run / "best")
    for argv in (["eval", str(run), "--device", "cpu"], ["export", str(run), str(tmp_path / "out")]):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2 and name in capsys.readouterr().err


def test_an_export_without_a_manifest_is_refused(whole, tmp_path):
    """Its files cannot be verified: the error names the manifest."""
    old = shutil.copytree(whole / "best", tmp_path / "old")
    (old / "manifest.json").unlink()
    with pytest.raises(ExportError, match="manifest.json is missing"):
        barter.load(old)


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


def test_damaged_config_json_is_a_clear_error(whole, tmp_path, capsys):
    run = shutil.copytree(whole, tmp_path / "run")
    for text in ('{"model": "cct', "[1, 2]", '{"no_such_field": 1}'):
        (run / "config.json").write_text(text)
        with pytest.raises(SystemExit) as exit_info:
            main(["train", "--resume", str(run)])
        assert exit_info.value.code == 2 and "config.json is damaged" in capsys.readouterr().err
    (run / "config.json").unlink()
    with pytest.raises(SystemExit):
        main(["train", "--resume", str(run)])
    assert "no config.json" in capsys.readouterr().err


def test_truncated_metrics_line_is_tolerated_and_repaired(whole, tmp_path):
    """A dying process's unfinished last line is read without it and rewritten on resume; a damaged line
    elsewhere is an error naming the file and the line."""
    run = shutil.copytree(whole, tmp_path / "run")
    shutil.rmtree(run / "last")  # as a run cut in epoch 2: resume from previous/ (epoch 1)
    metrics = run / "metrics.jsonl"
    lines = metrics.read_text().splitlines(keepends=True)
    metrics.write_text(lines[0] + lines[1][:20])
    assert [m["epoch"] for m in RunDir(run).metrics()] == [1]
    with pytest.warns(UserWarning, match="previous"):
        train(config(tmp_path, "run"), resume=True)
    assert_same_end(run, whole)
    metrics.write_text(lines[0][:20] + "\n" + lines[1])
    with pytest.raises(CheckpointError, match="metrics.jsonl is damaged at line 1"):
        RunDir(run).metrics()


def test_damaged_events_json_is_rewritten_on_resume(whole, tmp_path):
    run = shutil.copytree(whole, tmp_path / "run")
    shutil.rmtree(run / "last")
    (run / "events.jsonl").write_text('{"step": 1, "ki')
    with pytest.warns(UserWarning, match="previous"):
        train(config(tmp_path, "run"), resume=True)
    assert_same_end(run, whole)


def test_hf_callback_state_is_verified(tmp_path):
    path = tmp_path / "barter.pt"
    state = {"total_steps": 8, "controller": {"step": 3}, "batch": None}
    torch.save(pack_state(state), path)
    assert read_state(str(path)) == state
    packed = pack_state(state)
    packed["state"] = packed["state"][:-40] + bytes(40)
    torch.save(packed, path)
    with pytest.raises(ExportError, match="barter.pt: checksum mismatch"):
        read_state(str(path))
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(ExportError, match="barter.pt is damaged"):
        read_state(str(path))
    torch.save(state, path)  # without a checksum
    with pytest.raises(ExportError, match="barter.pt is damaged"):
        read_state(str(path))


def test_lightning_controller_state_is_verified():
    packed = pack_state({"step": 3})
    assert controller_state(packed, "epoch=0.ckpt") == {"step": 3}
    damaged = {**packed, "state": bytes(len(packed["state"]))}
    with pytest.raises(ExportError, match=r"epoch=0\.ckpt.*checksum mismatch"):
        controller_state(damaged, "epoch=0.ckpt")
    with pytest.raises(ExportError, match=r"epoch=0\.ckpt is damaged \(no checksummed state\)"):
        controller_state({"controller": {"step": 3}}, "epoch=0.ckpt")


def test_continue_from_names_a_damaged_checkpoint(whole, tmp_path):
    run = shutil.copytree(whole, tmp_path / "run")
    damage(run / "last" / "trainer.pt", "truncate")
    with pytest.raises(CheckpointError, match="trainer.pt"):
        train(replace(config(tmp_path, "cont"), continue_from=str(run), flop_budget=1e12))
