"""BARTER on two gloo processes (forked, CPU): the processes agree bitwise with each other and with one process
on the same global batches, a non-finite score on one process makes every process skip that batch's scores, and a
process group other than the default one is refused."""
import os
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from event_checks import assert_same_events
from forked import WORLD, fork_processes
from torch.multiprocessing import ProcessRaisedException

import barter
from barter import DistributedModel
from barter.training.processes import shard

timm = pytest.importorskip("timm")

STEPS, BATCH = 12, 8


def train_loop(world, poison=False):
    """STEPS optimizer steps of a wrapped tiny ViT on fixed global batches, each process on its share.

    With `poison`, this process alone records a NaN score before the second channel proposal.
    Returns the parameters, the optimizer state, the running scores, the skipped score batches and the events.
    """
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=5, img_size=32, patch_size=8,
                              depth=2, mlp_ratio=1.0)
    # SGD: Adam would turn the float noise in the key bias's gradient, which is zero, into steps of +-lr
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ctl = barter.wrap(model, opt, total_steps=STEPS, density=0.5, window=(0.1, 0.9))
    net = DistributedModel(model, ctl) if world > 1 else model
    poison_step = ctl.schedule["channel"][1] if poison else None
    for step in range(1, STEPS + 1):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(BATCH, 3, 32, 32, generator=g), torch.randint(0, 5, (BATCH,), generator=g)
        mine = shard(range(BATCH))
        loss = torch.nn.functional.cross_entropy(net(x[mine]), y[mine])
        opt.zero_grad()
        loss.backward()
        if step == poison_step:
            ctl.tables["channel"].pending[0, 0] = float("nan")
        opt.step()  # transfers run here, on every process alike
    scores = {kind.value: table.ema for kind, table in ctl.tables.items()}  # what torch.load(weights_only=True) reads
    return {"params": model.state_dict(), "optimizer": opt.state_dict(), "scores": scores,
            "events": [e.record() for e in ctl.events], "nonfinite": ctl.nonfinite_batches}


def loop_worker(rank, init_file, out_dir, poison):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=timedelta(minutes=2))  # a divergence fails instead of hanging
    try:
        torch.save(train_loop(WORLD, poison=poison and rank == 1), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_processes(tmp_path, poison=False):
    fork_processes(loop_worker, str(tmp_path / "init"), str(tmp_path), poison)
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]


def assert_equal_states(a, b):
    if isinstance(a, torch.Tensor):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_equal_states(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_equal_states(x, y)
    else:
        assert a == b


def test_processes_agree_bitwise_and_match_one_process(tmp_path):
    ranks = run_processes(tmp_path)
    assert_equal_states(ranks[0], ranks[1])  # parameters, optimizer state, scores and events
    single = train_loop(1)
    events = ranks[0]["events"]
    assert_same_events(events, single["events"])
    assert sum(e["skipped"] is None for e in events) >= 5
    assert ranks[0]["params"].keys() == single["params"].keys()
    for name, p in single["params"].items():
        torch.testing.assert_close(ranks[0]["params"][name], p, rtol=1e-4, atol=1e-5, msg=name)
    for kind, ema in single["scores"].items():  # the global batch's scores, not a multiple of them
        torch.testing.assert_close(ranks[0]["scores"][kind], ema, rtol=1e-4, atol=1e-9, msg=kind)


def test_a_non_finite_score_on_one_process_is_skipped_on_every_process(tmp_path):
    ranks = run_processes(tmp_path, poison=True)
    assert_equal_states(ranks[0], ranks[1])
    assert ranks[0]["nonfinite"] == {"head": 0, "channel": 1}  # the batch is dropped, the scores stay usable
    assert all(torch.isfinite(ema).all() for ema in ranks[0]["scores"].values())
    channel = [e for e in ranks[0]["events"] if e["kind"] == "channel"]
    assert channel[0]["skipped"] is None and channel[1]["skipped"] is None


def subgroup_worker(rank, init_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=timedelta(minutes=2))
    try:
        DistributedModel(torch.nn.Linear(2, 2), SimpleNamespace(edits=0), process_group=dist.new_group([0, 1]))
    finally:
        dist.destroy_process_group()


def test_a_process_group_other_than_the_default_is_refused(tmp_path):
    with pytest.raises(ProcessRaisedException, match="on the default process group only"):
        fork_processes(subgroup_worker, str(tmp_path / "init"))
