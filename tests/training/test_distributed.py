"""Multi-process training on CPU (two gloo processes, forked): batch shares, and the training pipeline under
torchrun's environment writes from rank 0 only, resumes, and matches one process."""
import json
import math
import os
from dataclasses import asdict

import pytest
import torch
from event_checks import assert_same_events
from forked import WORLD, fork_processes, free_ports
from interrupted import cut_at_second_epoch_and_resume

from barter.training import TrainConfig, processes, train
from barter.training.processes import shard
from barter.training.runlog import RunDir, load_checkpoint

pytest.importorskip("timm")


@pytest.mark.parametrize("granule", [1, 2])
def test_shares_cover_the_batch_in_whole_granules(monkeypatch, granule):
    batch = list(range(100, 122))
    shares = []
    for r in range(3):
        monkeypatch.setattr(processes, "world_size", lambda: 3)
        monkeypatch.setattr(processes, "rank", lambda r=r: r)
        shares.append(shard(batch, granule))
    assert [i for share in shares for i in share] == batch
    assert all(len(s) % granule == 0 for s in shares)
    assert max(map(len, shares)) - min(map(len, shares)) <= granule


def pipeline_config(tmp_path, name):
    """Two epochs of 3 steps: 41 fake images in batches of 16, so the last batch (9) splits 4 + 5."""
    return TrainConfig(model="vit_paper_p8_64_tiny", img_size=16, model_kwargs={"patch_size": 4, "drop_path_rate": 0.0},
                       dataset="fake", fake_size=41, recipe="none", batch_size=16, epochs=2, lr=2e-3, warmup_epochs=0.5,
                       device="cpu", out_dir=str(tmp_path), name=name, progress=False, density=0.5,
                       barter_options={"window": (0.1, 0.9)})


def pipeline_worker(rank, ports, out_dir):
    """Under torchrun's variables: a run cut at the start of its second epoch, then resumed."""
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1")
    if rank != 0:
        def refuse(*args, **kwargs):
            raise AssertionError("only rank 0 writes the run directory")
        RunDir.save_checkpoint = RunDir.append_metrics = RunDir.write_json = refuse
    result = cut_at_second_epoch_and_resume(pipeline_config(out_dir, "cut"), ports)
    (out_dir / f"result{rank}.json").write_text(json.dumps(asdict(result), default=str))


def test_training_pipeline_under_torchrun_resumes_and_matches_one_process(tmp_path):
    fork_processes(pipeline_worker, free_ports(2), tmp_path)
    results = [json.loads((tmp_path / f"result{r}.json").read_text()) for r in range(WORLD)]
    assert results[0] == results[1]  # every rank returns rank 0's result
    resumed = load_checkpoint(RunDir(tmp_path / "cut").last)
    assert resumed["step"] == 6 and resumed["finished"]
    assert [m["epoch"] for m in RunDir(tmp_path / "cut").metrics()] == [1, 2]
    single = train(pipeline_config(tmp_path, "single"))  # one process on the same global batches
    one = load_checkpoint(RunDir(single.run_dir).last)
    assert_same_events(resumed["controller"]["events"], one["controller"]["events"])
    assert sum(e["skipped"] is None for e in one["controller"]["events"]) >= 3
    assert resumed["flops"] == one["flops"]
    for name, p in one["model"].items():
        torch.testing.assert_close(resumed["model"][name], p, rtol=1e-4, atol=1e-5, msg=name)
    a, b = RunDir(tmp_path / "cut").metrics()[-1], RunDir(single.run_dir).metrics()[-1]
    assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5) and a["train_acc"] == b["train_acc"]
