"""The training pipeline with `fsdp` on two gloo processes under torchrun's environment (forked): transfers run on
the sharded model, every rank writes its shards of each checkpoint through torch.distributed.checkpoint beside rank
0's export of the whole model, and a run cut after a transfer and resumed from its checkpoint ends with the
uninterrupted run's parameters and events, also when a layer has lost every head (its parameters have no elements);
`barter train --fsdp` itself runs under torchrun."""
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from forked import WORLD, fork_processes, free_ports
from interrupted import cut_at_second_epoch_and_resume
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import barter
from barter.fsdp import gathered_state_dict, shard
from barter.training import TrainConfig, train
from barter.training.runlog import RunDir, load_checkpoint

pytest.importorskip("timm")
ROOT = Path(__file__).resolve().parents[2]
BUILT_ON_META = "built on the meta device, each process writing only its shards"  # in the header of such a run


def fsdp_config(out_dir, name):
    """Two epochs of 3 steps of a tiny ViT on 41 fake images in batches of 16 (the last splits 4 + 5)."""
    return TrainConfig(model="vit_paper_p8_64_tiny", img_size=16, model_kwargs={"patch_size": 4, "drop_path_rate": 0.0},
                       dataset="fake", fake_size=41, recipe="none", batch_size=16, epochs=2, lr=2e-3, warmup_epochs=0.5,
                       device="cpu", out_dir=str(out_dir), name=name, progress=False, density=0.5, fsdp=True,
                       barter_options={"window": (0.1, 0.9)})


def emptying_config(out_dir, name):
    """`fsdp_config` at one head in each layer (of 3, dim 33: a layer's emptied output projection, 33 x 0, splits
    unevenly over the processes): the head transfer after step 3 empties its donor before the epoch-1 checkpoint."""
    config = fsdp_config(out_dir, name)
    return replace(config, density=0.34, model_kwargs={**config.model_kwargs, "embed_dim": 33, "num_heads": 3})


def worker(rank, ports, out_dir, make_config):
    """An uninterrupted run, then a run cut at the start of its second epoch (after the epoch-1 checkpoint, which
    follows transfers) and resumed."""
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(ports[0]))
    train(make_config(out_dir, "whole"))
    cut_at_second_epoch_and_resume(make_config(out_dir, "cut"), ports[1:])


def runs_worker(rank, ports, out_dir, runs):
    """One run of `fsdp_config` per (name, changes) of `runs`, in turn, each on its own port; rank 0 writes each
    run's header in `<name>.header`."""
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1")
    for (name, changes), port in zip(runs, ports):
        os.environ["MASTER_PORT"] = str(port)
        headers = []
        train(replace(fsdp_config(out_dir, name), **changes), header=headers.append)
        if rank == 0:
            (out_dir / f"{name}.header").write_text("\n".join(headers))


def assert_built_on_meta_equals_built_whole(out_dir, meta_name, whole_name):
    """Run `meta_name` was built on the meta device, run `whole_name` whole on every process, and they made the same
    transfers (on non-zero scores) and end with the same parameters and metrics, bit for bit; the whole run's last
    checkpoint."""
    assert BUILT_ON_META in (out_dir / f"{meta_name}.header").read_text()
    assert BUILT_ON_META not in (out_dir / f"{whole_name}.header").read_text()
    meta_run, whole_run = RunDir(out_dir / meta_name), RunDir(out_dir / whole_name)
    on_meta, whole = load_checkpoint(meta_run.last), load_checkpoint(whole_run.last)
    events = whole["controller"]["events"]
    done = [e for e in events if e["skipped"] is None]
    assert done and all(e["donor_D"] > 0 and e["parent_S"] > 0 for e in done)
    assert on_meta["controller"]["events"] == events
    assert on_meta["controller"]["topology"] == whole["controller"]["topology"]
    assert on_meta["model"].keys() == whole["model"].keys()
    for name, p in whole["model"].items():
        torch.testing.assert_close(on_meta["model"][name], p, rtol=0, atol=0, msg=name)
    measured = ("loss", "train_acc", "test_loss", "acc")
    assert [[m[k] for k in measured] for m in meta_run.metrics()] == \
        [[m[k] for k in measured] for m in whole_run.metrics()]
    return whole


def fine_tune_worker(rank, init_file, export, out_dir):
    """The export loaded, sharded by `barter.fsdp.shard` and trained for two Adam steps: the gathered parameters."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        model = shard(barter.load(export))
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        for step in range(2):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(4, 3, 16, 16, generator=g), torch.randint(0, 10, (4,), generator=g)
            torch.nn.functional.cross_entropy(model(x[2 * rank:2 * rank + 2]), y[2 * rank:2 * rank + 2]).backward()
            optimizer.step()
            optimizer.zero_grad()
        torch.save(gathered_state_dict(model), os.path.join(out_dir, f"tuned{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_cut_and_whole(out_dir, make_config) -> tuple[dict, dict]:
    """The uninterrupted and the resumed run's last checkpoints, after checking that they are equal: parameters,
    events (some transfer ran by the epoch-1 checkpoint) and steps; the resumed one also wrote its shards."""
    fork_processes(worker, free_ports(3), out_dir, make_config)
    whole, resumed = load_checkpoint(RunDir(out_dir / "whole").last), load_checkpoint(RunDir(out_dir / "cut").last)
    assert resumed["step"] == whole["step"] == 6 and resumed["finished"]
    events = whole["controller"]["events"]
    executed_by_epoch_1 = [e for e in events if e["skipped"] is None and e["step"] <= 3]
    assert executed_by_epoch_1 and resumed["controller"]["events"] == events
    assert {f"__{r}_0.distcp" for r in range(WORLD)} <= {f.name for f in (out_dir / "cut" / "last").iterdir()}
    for name, p in whole["model"].items():
        torch.testing.assert_close(resumed["model"][name], p, rtol=0, atol=0, msg=name)
    assert [m["epoch"] for m in RunDir(out_dir / "cut").metrics()] == [1, 2]
    return whole, resumed


def test_fsdp_pipeline_checkpoints_resume_and_export(tmp_path):
    whole, _ = run_cut_and_whole(tmp_path, fsdp_config)
    compact = barter.load(tmp_path / "whole" / "best")  # rank 0's export is an ordinary compact model
    assert {k: v.shape for k, v in compact.state_dict().items()} == {k: v.shape for k, v in whole["model"].items()}


def test_a_run_built_on_meta_equals_the_run_built_whole(tmp_path):
    fork_processes(runs_worker, free_ports(2), tmp_path, [("meta", {}), ("whole", {"fsdp_on_meta": False})])
    assert_built_on_meta_equals_built_whole(tmp_path, "meta", "whole")


def test_under_bf16_autocast_a_run_built_on_meta_equals_the_run_built_whole(tmp_path):
    """The same under `amp="bf16"`, whose forwards autocast to bfloat16: the run differs from the fp32 one."""
    runs = [("meta", {"amp": "bf16"}), ("whole", {"amp": "bf16", "fsdp_on_meta": False}), ("fp32", {})]
    fork_processes(runs_worker, free_ports(3), tmp_path, runs)
    whole = assert_built_on_meta_equals_built_whole(tmp_path, "meta", "whole")
    fp32 = load_checkpoint(RunDir(tmp_path / "fp32").last)
    assert any(not torch.equal(fp32["model"][name], p) for name, p in whole["model"].items())


def test_fsdp_pipeline_with_a_layer_emptied_of_heads(tmp_path):
    whole, resumed = run_cut_and_whole(tmp_path, emptying_config)
    emptied = [e for e in whole["controller"]["events"] if e["kind"] == "head" and e["skipped"] is None]
    assert [e["step"] for e in emptied] == [3]  # every layer had one head: the donor has none since
    donor = emptied[0]["donor_layer"]
    assert whole["controller"]["topology"][f"{donor}:head"] == 0
    assert whole["model"][f"{donor}.qkv.weight"].shape == (0, 33)
    assert whole["model"][f"{donor}.proj.weight"].shape == (33, 0)
    assert all(torch.isfinite(p).all() for p in whole["model"].values())
    # the export rank 0 gathered, reloaded, equals the shards every rank wrote of the resumed run's live model
    dcp_to_torch_save(tmp_path / "cut" / "last", tmp_path / "shards.pt")
    shards = torch.load(tmp_path / "shards.pt", weights_only=True)["model"]
    compact = barter.load(tmp_path / "cut" / "last")
    assert compact.state_dict().keys() == shards.keys()
    for name, p in compact.state_dict().items():
        torch.testing.assert_close(p, shards[name], rtol=0, atol=0, msg=name)
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(compact.eval()(x)).all()
    # the export, with its empty layer, sharded and trained on: every rank steps the same finite parameters
    fork_processes(fine_tune_worker, str(tmp_path / "init"), tmp_path / "cut" / "last", tmp_path)
    tuned = [torch.load(tmp_path / f"tuned{r}.pt", weights_only=True) for r in range(WORLD)]
    assert {k: v.shape for k, v in tuned[0].items()} == {k: v.shape for k, v in shards.items()}
    assert not torch.equal(tuned[0]["head.weight"], shards["head.weight"])  # it trained
    for name, p in tuned[0].items():
        assert torch.isfinite(p).all() and torch.equal(p, tuned[1][name]), name


def test_barter_train_fsdp_under_torchrun_on_the_default_preset(tmp_path):
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    # --standalone: the rendezvous binds a free port itself (a port chosen here could be taken before torchrun binds it)
    command = [torchrun, "--standalone", "--nproc_per_node", "2", "-m", "barter", "train",
               "--fsdp", "--device", "cpu", "--dataset", "fake", "--fake-size", "32", "--batch-size", "16",
               "--epochs", "2", "--density", "0.5", "--out-dir", str(tmp_path), "--name", "run", "--no-progress"]
    done = subprocess.run(command, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300,
                          capture_output=True, text=True)
    assert done.returncode == 0, f"torchrun exited {done.returncode}:\n{done.stderr[-6000:]}"
    assert BUILT_ON_META in done.stdout
    last = load_checkpoint(tmp_path / "run" / "last")
    assert last["finished"] and any(e["skipped"] is None for e in last["controller"]["events"])
