"""The training pipeline with `fsdp` on two gloo processes under torchrun's environment (forked): transfers run on
the sharded model, every rank writes its shards of each checkpoint through torch.distributed.checkpoint beside rank
0's export of the whole model, and a run cut after a transfer and resumed from its checkpoint ends with the
uninterrupted run's parameters and events; `barter train --fsdp` itself runs under torchrun."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from forked import WORLD, fork_processes, free_ports
from interrupted import cut_at_second_epoch_and_resume

import barter
from barter.training import TrainConfig, train
from barter.training.runlog import RunDir, load_checkpoint

pytest.importorskip("timm")
ROOT = Path(__file__).resolve().parents[2]


def fsdp_config(out_dir, name):
    """Two epochs of 3 steps of a tiny ViT on 41 fake images in batches of 16 (the last splits 4 + 5)."""
    return TrainConfig(model="vit_paper_p8_64_tiny", img_size=16, model_kwargs={"patch_size": 4, "drop_path_rate": 0.0},
                       dataset="fake", fake_size=41, recipe="none", batch_size=16, epochs=2, lr=2e-3, warmup_epochs=0.5,
                       device="cpu", out_dir=str(out_dir), name=name, progress=False, density=0.5, fsdp=True,
                       barter_options={"window": (0.1, 0.9)})


def worker(rank, ports, out_dir):
    """An uninterrupted run, then a run cut at the start of its second epoch (after the epoch-1 checkpoint, which
    follows transfers) and resumed."""
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(ports[0]))
    train(fsdp_config(out_dir, "whole"))
    cut_at_second_epoch_and_resume(fsdp_config(out_dir, "cut"), ports[1:])


def test_fsdp_pipeline_checkpoints_resume_and_export(tmp_path):
    fork_processes(worker, free_ports(3), tmp_path)
    whole, resumed = load_checkpoint(RunDir(tmp_path / "whole").last), load_checkpoint(RunDir(tmp_path / "cut").last)
    assert resumed["step"] == whole["step"] == 6 and resumed["finished"]
    events = whole["controller"]["events"]
    executed_by_epoch_1 = [e for e in events if e["skipped"] is None and e["step"] <= 3]
    assert executed_by_epoch_1 and resumed["controller"]["events"] == events
    assert {f"__{r}_0.distcp" for r in range(WORLD)} <= {f.name for f in (tmp_path / "cut" / "last").iterdir()}
    for name, p in whole["model"].items():
        torch.testing.assert_close(resumed["model"][name], p, rtol=0, atol=0, msg=name)
    compact = barter.load(tmp_path / "whole" / "best")  # rank 0's export is an ordinary compact model
    assert {k: v.shape for k, v in compact.state_dict().items()} == {k: v.shape for k, v in whole["model"].items()}
    assert [m["epoch"] for m in RunDir(tmp_path / "cut").metrics()] == [1, 2]


def test_barter_train_fsdp_under_torchrun_on_the_default_preset(tmp_path):
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    command = [torchrun, "--nproc_per_node", "2", "--master_port", str(free_ports(1)[0]), "-m", "barter", "train",
               "--fsdp", "--device", "cpu", "--dataset", "fake", "--fake-size", "32", "--batch-size", "16",
               "--epochs", "2", "--density", "0.5", "--out-dir", str(tmp_path), "--name", "run", "--no-progress"]
    subprocess.run(command, cwd=ROOT, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    last = load_checkpoint(tmp_path / "run" / "last")
    assert last["finished"] and any(e["skipped"] is None for e in last["controller"]["events"])
