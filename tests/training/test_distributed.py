"""Multi-process training on CPU (two gloo processes, forked): the processes agree bitwise with each other and
with one process on the same global batches, a non-finite score skips a proposal everywhere, and the training
pipeline under torchrun's environment writes from rank 0 only, resumes, and matches one process."""
import json
import math
import os
import socket
from dataclasses import asdict
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import barter
import barter.train as train_module
from barter import distributed
from barter.distributed import DistributedModel, shard
from barter.runlog import RunDir, load_checkpoint
from barter.train import TrainConfig, train

timm = pytest.importorskip("timm")
if "fork" not in mp.get_all_start_methods():
    pytest.skip("the processes are forked (no re-import of torch and timm)", allow_module_level=True)

WORLD, STEPS, BATCH = 2, 12, 8


def fork_processes(fn, *args):
    mp.start_processes(fn, args=args, nprocs=WORLD, start_method="fork")


def free_ports(n):
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


@pytest.mark.parametrize("granule", [1, 2])
def test_shares_cover_the_batch_in_whole_granules(monkeypatch, granule):
    batch = list(range(100, 122))
    shares = []
    for r in range(3):
        monkeypatch.setattr(distributed, "world_size", lambda: 3)
        monkeypatch.setattr(distributed, "rank", lambda r=r: r)
        shares.append(shard(batch, granule))
    assert [i for share in shares for i in share] == batch
    assert all(len(s) % granule == 0 for s in shares)
    assert max(map(len, shares)) - min(map(len, shares)) <= granule


def train_loop(world, poison=False):
    """STEPS optimizer steps of a wrapped tiny ViT on fixed global batches, each process on its share.

    With `poison`, this process alone records a NaN score before the second channel proposal.
    Returns the parameters, the optimizer state, the running scores and the events.
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
    scores = {kind: table.ema for kind, table in ctl.tables.items()}
    return {"params": model.state_dict(), "optimizer": opt.state_dict(), "scores": scores, "events": ctl.events}


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
    assert events == single["events"]
    assert sum(e["skipped"] is None for e in events) >= 5
    assert ranks[0]["params"].keys() == single["params"].keys()
    for name, p in single["params"].items():
        torch.testing.assert_close(ranks[0]["params"][name], p, rtol=1e-4, atol=1e-5, msg=name)
    for kind, ema in single["scores"].items():  # the global batch's scores, not a multiple of them
        torch.testing.assert_close(ranks[0]["scores"][kind], ema, rtol=1e-4, atol=1e-9, msg=kind)


def test_a_non_finite_score_on_one_process_skips_the_proposal_on_every_process(tmp_path):
    ranks = run_processes(tmp_path, poison=True)
    assert_equal_states(ranks[0], ranks[1])
    channel = [e for e in ranks[0]["events"] if e["kind"] == "channel"]
    assert channel[0]["skipped"] is None and channel[1]["skipped"] == "non-finite scores"


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
    real_epoch = train_module._train_epoch

    def cut_at_second_epoch(session, *args):
        if session.epoch >= 1:
            raise KeyboardInterrupt
        return real_epoch(session, *args)

    train_module._train_epoch = cut_at_second_epoch
    os.environ["MASTER_PORT"] = str(ports[0])
    with pytest.raises(KeyboardInterrupt):
        train(pipeline_config(out_dir, "cut"))
    train_module._train_epoch = real_epoch
    os.environ["MASTER_PORT"] = str(ports[1])
    result = train(pipeline_config(out_dir, "cut"), resume=True)
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
    assert resumed["controller"]["events"] == one["controller"]["events"]
    assert sum(e["skipped"] is None for e in one["controller"]["events"]) >= 3
    assert resumed["flops"] == one["flops"]
    for name, p in one["model"].items():
        torch.testing.assert_close(resumed["model"][name], p, rtol=1e-4, atol=1e-5, msg=name)
    a, b = RunDir(tmp_path / "cut").metrics()[-1], RunDir(single.run_dir).metrics()[-1]
    assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5) and a["train_acc"] == b["train_acc"]
