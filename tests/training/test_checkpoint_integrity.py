"""Checkpoints that cannot silently poison a run: every file checked against the manifest, a fallback to the
previous checkpoint, damaged run logs, and the integrations' states (cut runs: test_checkpoint_cuts.py)."""
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from checkpoint_runs import assert_same_end, config

import barter
from barter.integrations.hf import read_state
from barter.integrations.lightning import controller_state
from barter.serialization import ExportError, pack_state
from barter.training import train
from barter.training.cli import main
from barter.training.runlog import CheckpointError, RunDir

FILES = ("manifest.json", "model.safetensors", "topology.json", "trainer.pt", "model.pt2")


def damage(file: Path, fault: str) -> None:
    data = file.read_bytes()
    if fault == "flip":
        middle = len(data) // 2
        file.write_bytes(data[:middle] + bytes(b ^ 0xFF for b in data[middle:middle + 64]) + data[middle + 64:])
    elif fault == "truncate":
        file.write_bytes(data[:len(data) // 2])
    else:
        file.unlink()


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
