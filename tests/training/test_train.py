"""Training pipeline on tiny models and fake data: every method, outputs, FLOP budget, matched-compute
continuation, resume equality, recipe pieces and bad inputs."""
import importlib.util
import json
import math
import shutil
from dataclasses import replace

import pytest
import torch
from interrupted import cut_and_resume

import barter
from barter.serialization import write_manifest
from barter.training import PRESETS, ConfigError, TrainConfig, preset, train
from barter.training.batches import epoch_batches, steps_per_epoch
from barter.training.data import DatasetNotFoundError
from barter.training.evaluation import macro_f1
from barter.training.recipe import WarmupCosine, build_optimizer
from barter.training.runlog import CheckpointError, RunDir, load_checkpoint, width_history
from barter.training.session import build_data, build_session

MODELS = {
    "cct": {"model": "cct_2_3x1_32_tiny", "img_size": 16},
    "vit": {"model": "vit_paper_p8_64_tiny", "img_size": 16, "model_kwargs": {"patch_size": 4}},
}
WRAPPED = ("static", "barter", "random_receiver", "random_donor", "random_pair")
BASELINES = ("rigl", "set", "snfs", "srigl", "s2vite")
UPDATES = {"update_interval": 2}  # mask updates at steps 2, 4 and 6 of a baseline's 8


def config(tmp_path, arch="cct", **kw) -> TrainConfig:
    """Two epochs of 4 steps (64 fake images, batch 16), 16 test images, no progress output."""
    base = {"dataset": "fake", "fake_size": 64, "batch_size": 16, "epochs": 2, "lr": 2e-3, "warmup_epochs": 0.5,
            "device": "cpu", "out_dir": str(tmp_path), "progress": False, "density": 0.5,
            "barter_options": {"window": (0.1, 0.9)}}
    return TrainConfig(**{**base, **MODELS[arch], **kw})


@pytest.mark.parametrize("arch", sorted(MODELS))
@pytest.mark.parametrize("method", ["dense", *WRAPPED, *BASELINES])
def test_every_method_trains_and_writes_its_run(tmp_path, arch, method):
    options = UPDATES if method in BASELINES else {}
    result = train(config(tmp_path, arch, method=method, name="run", baseline_options=options))
    run = tmp_path / "run"
    assert result.run_dir == run and result.epochs == 2 and result.steps == 8
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["epoch"] for m in metrics] == [1, 2]
    for m in metrics:
        assert {"loss", "acc", "macro_f1", "lr", "flops", "wall_s"} <= set(m) and math.isfinite(m["loss"])
    assert 0 < metrics[0]["flops"] < metrics[1]["flops"] == result.flops
    assert json.loads((run / "config.json").read_text())["method"] == method
    last = load_checkpoint(run / "last")
    assert (run / "best" / "model.safetensors").is_file() and last["finished"] and last["step"] == 8
    if method in WRAPPED:
        assert last["controller"]["step"] == 8  # one controller step per optimizer step
        events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
        assert events == last["controller"]["events"]
        assert (len(events) > 0) == (method != "static") and result.transfers <= len(events)
        assert (run / "widths.png").read_bytes()[:4] == b"\x89PNG"
        history = width_history(json.loads((run / "topology.json").read_text()), events)
        for layers in history.values():  # transfers move units between layers; the total stays
            assert len({sum(s[0][1] for s in layers.values()), sum(s[-1][1] for s in layers.values())}) == 1
    else:
        assert not (run / "events.jsonl").exists()
    if method in BASELINES:
        assert last["sparse"]["step"] == 8 and all(0 < m["sparse"]["density"] <= 0.5 + 1e-9 for m in metrics)
    if method == "srigl":  # every epoch logs each sparse layer's fraction of ablated neurons
        assert all(set(m["sparse"]["ablated_fraction"]) == set(last["sparse"]["masks"]) for m in metrics)
        assert all(0 <= f < 1 for m in metrics for f in m["sparse"]["ablated_fraction"].values())
    assert (run / "compact").is_dir() == (method == "s2vite")
    assert ("compact_parameters" in metrics[-1]) == (method == "s2vite")


def test_resume_equals_uninterrupted(tmp_path, monkeypatch):
    """Crash in the second epoch's evaluation, resume from the epoch-1 checkpoint: same weights and events."""
    whole = train(config(tmp_path, method="barter", name="whole"))
    resumed = cut_and_resume(monkeypatch, config(tmp_path, method="barter", name="cut"), crash_at=2)
    a, b = load_checkpoint(whole.run_dir / "last"), load_checkpoint(resumed.run_dir / "last")
    assert a["controller"]["events"] == b["controller"]["events"]
    assert any(e["step"] > 4 and e["skipped"] is None for e in a["controller"]["events"])  # after the cut
    assert a["model"].keys() == b["model"].keys()
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name
    assert a["flops"] == b["flops"]
    lines = (resumed.run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["epoch"] for line in lines] == [1, 2]


@pytest.mark.parametrize("method", BASELINES)
def test_baseline_resume_equals_uninterrupted(tmp_path, monkeypatch, method):
    """A baseline cut in the second epoch's evaluation and resumed: same weights, masks, optimizer and FLOPs."""
    whole = train(config(tmp_path, method=method, name="whole", baseline_options=UPDATES))
    resumed = cut_and_resume(monkeypatch, config(tmp_path, method=method, name="cut", baseline_options=UPDATES),
                             crash_at=2)
    a, b = load_checkpoint(whole.run_dir / "last"), load_checkpoint(resumed.run_dir / "last")
    masks = "unit_masks" if method == "s2vite" else "masks"
    assert a["sparse"][masks].keys() == b["sparse"][masks].keys() and a["sparse"]["step"] == b["sparse"]["step"]
    assert all(torch.equal(m, b["sparse"][masks][n]) for n, m in a["sparse"][masks].items())
    assert a["model"].keys() == b["model"].keys()
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name
    for key, state in a["optimizer"]["state"].items():
        assert all(torch.equal(v, b["optimizer"]["state"][key][k]) for k, v in state.items())
    assert a["flops"] == b["flops"]
    assert RunDir(whole.run_dir).metrics() == [{**m, "wall_s": w["wall_s"]} for m, w in
                                               zip(RunDir(resumed.run_dir).metrics(), RunDir(whole.run_dir).metrics())]


def test_masked_baselines_count_the_dense_flops(tmp_path):
    """Every baseline trains full-width tensors under masks: the FLOP meter counts Dense's executed step."""
    dense = train(config(tmp_path, method="dense", name="dense", epochs=1))
    for method in BASELINES:
        result = train(config(tmp_path, method=method, name=method, epochs=1, baseline_options=UPDATES))
        assert result.flops == dense.flops > 0, method


def test_s2vite_compact_export_equals_its_masked_model(tmp_path):
    """run/compact is the best checkpoint without its dead units: fewer parameters, the same outputs."""
    result = train(config(tmp_path, "vit", method="s2vite", name="run", baseline_options=UPDATES))
    masked, compact = barter.load(result.run_dir / "best").eval(), barter.load(result.run_dir / "compact").eval()
    parameters = sum(p.numel() for p in compact.parameters())
    assert parameters == RunDir(result.run_dir).metrics()[-1]["compact_parameters"]
    assert parameters < sum(p.numel() for p in masked.parameters())
    topology = json.loads((result.run_dir / "compact" / "topology.json").read_text())
    assert topology["parameters"] == parameters and any(g["count"] < g["max_count"] for g in topology["groups"])
    x = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(compact(x), masked(x), rtol=1e-4, atol=1e-5)


def test_baseline_options_are_checked(tmp_path):
    with pytest.raises(ConfigError, match="no option.*gamma"):
        train(config(tmp_path, method="snfs", baseline_options={"gamma_sal": 0.1}))
    with pytest.raises(ConfigError, match="baseline_options apply"):
        train(config(tmp_path, method="barter", baseline_options=UPDATES))
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("method", ["dense", "barter"])
def test_checkpoints_are_exports_that_barter_loads(tmp_path, method):
    """best/ and last/ hold the weights, topology, torch.export program and trainer state; barter.load gives the
    trained model."""
    result = train(config(tmp_path, "vit", method=method, name="run"))
    board = ["tensorboard"] if importlib.util.find_spec("tensorboard") else []  # event files, when installed
    assert sorted(p.name for p in result.run_dir.iterdir() if p.is_dir()) == ["best", "last", "previous", *board]
    assert sorted(p.name for p in (result.run_dir / "last").iterdir()) == [
        "manifest.json", "model.pt2", "model.safetensors", "topology.json", "trainer.pt"]
    model = barter.load(result.run_dir / "last")
    weights = load_checkpoint(result.run_dir / "last")["model"]
    assert model.state_dict().keys() == weights.keys()
    assert all(torch.equal(tensor, weights[key]) for key, tensor in model.state_dict().items())
    topology = json.loads((result.run_dir / "last" / "topology.json").read_text())
    assert topology["parameters"] == sum(p.numel() for p in model.parameters())
    assert any(g["count"] < g["max_count"] for g in topology["groups"]) == (method == "barter")
    model.eval()(torch.zeros(2, 3, 16, 16))


def test_flop_budget_stops_mid_epoch_within_budget(tmp_path):
    full = train(config(tmp_path, method="dense", name="full"))
    budget = full.flops / full.steps * 5.5  # every step has the same shapes: 5 steps fit, the 6th would not
    part = train(config(tmp_path, method="dense", name="part", flop_budget=budget))
    assert part.steps == 5 and part.epochs == 1.25 and part.flops <= budget
    lines = (part.run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["epoch"] for line in lines] == [1, 1.25]


def test_matched_compute_continuation(tmp_path):
    base = config(tmp_path, method="barter", name="base")
    first = train(base)
    start = load_checkpoint(first.run_dir / "last")
    budget = first.flops * 2
    cont = train(replace(base, name="cont", continue_from=str(first.run_dir), flop_budget=budget))
    end = load_checkpoint(cont.run_dir / "last")
    assert end["controller"]["events"] == start["controller"]["events"]  # topology fixed
    assert end["controller"]["topology"] == start["controller"]["topology"]
    assert cont.flops <= budget and cont.flops > budget - first.flops / first.steps
    assert end["schedule"]["start"] == start["step"] and end["step"] > start["step"]
    assert all(float(s["step"]) == end["step"] for s in end["optimizer"]["state"].values())  # counters kept
    assert end["epoch"] > start["epoch"]
    with pytest.raises(ConfigError, match="flop_budget"):
        train(replace(base, name="c1", continue_from=str(first.run_dir)))
    with pytest.raises(ConfigError, match="leaves no step"):
        train(replace(base, name="c2", continue_from=str(first.run_dir), flop_budget=first.flops))


def test_checkpoint_errors(tmp_path):
    cfg = config(tmp_path, method="dense", name="run", epochs=1)
    train(cfg)
    with pytest.raises(CheckpointError, match="lr"):
        train(replace(cfg, lr=0.5), resume=True)
    weights = tmp_path / "run" / "last" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8])
    with pytest.raises(CheckpointError, match="cannot read .*checksum"):
        train(cfg, resume=True)
    (tmp_path / "run" / "last" / "trainer.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="cannot read"):
        train(cfg, resume=True)
    with pytest.raises(CheckpointError, match="no checkpoint"):
        train(replace(cfg, name="missing"), resume=True)
    with pytest.raises(ConfigError, match="exists"):
        train(cfg)


def test_fine_tuning_starts_from_dense_weights_and_keeps_a_classifier_of_the_same_classes(tmp_path):
    source = train(config(tmp_path, "vit", method="dense", name="src", epochs=1))
    dense = load_checkpoint(source.run_dir / "best")["model"]
    tuned = config(tmp_path, "vit", method="dense", name="ft", epochs=1, lr=1e-12, min_lr=0, weight_decay=0,
                   init_from=str(source.run_dir))
    data = build_data(tuned)
    session = build_session(tuned, data, torch.device("cpu"), 4, pretrained=True)
    state = session.model.state_dict()
    assert torch.equal(state["blocks.0.attn.qkv.weight"], dense["blocks.0.attn.qkv.weight"])
    assert torch.equal(state["head.weight"], dense["head.weight"])  # same classes (a new head: test_score_init.py)
    sparse = replace(tuned, method="barter", barter_options={"init": "magnitude"})
    session = build_session(sparse, data, torch.device("cpu"), 4, pretrained=True)
    kept = session.model.state_dict()["blocks.0.mlp.fc1.weight"]
    rows = {tuple(r.tolist()) for r in dense["blocks.0.mlp.fc1.weight"]}
    assert kept.shape[0] < len(rows) and all(tuple(r.tolist()) in rows for r in kept)
    compact = shutil.copytree(source.run_dir / "best", tmp_path / "compact")
    trainer = torch.load(compact / "trainer.pt", weights_only=True)
    torch.save({**trainer, "controller": {"step": 0}}, compact / "trainer.pt")  # as a wrapped run's state has
    write_manifest(compact)
    with pytest.raises(CheckpointError, match="dense"):
        train(replace(tuned, name="ft2", init_from=str(compact)))


@pytest.mark.parametrize("kw,match", [
    ({"density": 0.0}, "density"), ({"density": 1.5}, "density"), ({"method": "magic"}, "method"),
    ({"epochs": 0}, "epochs"), ({"model": "no_such_model"}, "model"),
])
def test_bad_config_values(tmp_path, kw, match):
    with pytest.raises(ValueError, match=match):
        train(config(tmp_path, **kw))
    assert not any(tmp_path.iterdir())  # nothing written


def test_missing_data_dir(tmp_path):
    with pytest.raises(DatasetNotFoundError, match="CIFAR-100 not found"):
        train(replace(preset("cct_cifar100"), data_dir=str(tmp_path / "nowhere"), out_dir=str(tmp_path / "runs")))
    assert not (tmp_path / "runs").exists()


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown preset"):
        preset("imagenet_giant")
    assert all(isinstance(preset(name), TrainConfig) for name in PRESETS)


@pytest.mark.parametrize("decay", ["before", "after"])
def test_decoupled_weight_decay_order(decay):
    """After: Adam's update, then p *= 1 - lr*wd. Before: p *= 1 - lr*wd, then Adam's update (AdamW)."""
    lr, wd = 0.1, 0.5
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    opt = build_optimizer([p], lr=lr, weight_decay=wd, decay=decay)
    p.grad = torch.tensor([0.5, 0.25])
    opt.step()
    adam_update = lr * torch.sign(torch.tensor([0.5, 0.25]))  # Adam's first step is lr * sign(g) (up to eps)
    start = torch.tensor([1.0, -2.0])
    expected = (start - adam_update) * (1 - lr * wd) if decay == "after" else start * (1 - lr * wd) - adam_update
    torch.testing.assert_close(p.detach(), expected)


def test_warmup_cosine():
    s = WarmupCosine(base_lr=1.0, min_lr=0.1, warmup_steps=4, total_steps=14, start=100)
    assert [s.lr(100 + k) for k in range(4)] == [0.25, 0.5, 0.75, 1.0]
    lrs = [s.lr(100 + k) for k in range(4, 15)]
    assert lrs == sorted(lrs, reverse=True) and lrs[-1] == pytest.approx(0.1)
    assert s.lr(100 + 9) == pytest.approx(0.55)


def test_macro_f1_by_hand():
    target = torch.tensor([0, 0, 1, 1, 2])
    pred = torch.tensor([0, 1, 1, 1, 0])
    # class 0: tp 1, fp 1, fn 1 -> 0.5; class 1: tp 2, fp 1, fn 0 -> 0.8; class 2: tp 0 -> 0; class 3 absent
    assert macro_f1(pred, target, 4) == pytest.approx((0.5 + 0.8 + 0.0) / 3)


def test_epoch_batches_are_seeded_per_epoch():
    cfg = TrainConfig(batch_size=16, passes=3, drop_last=True)
    one = epoch_batches(50, cfg, False, torch.Generator().manual_seed(7))
    assert one == epoch_batches(50, cfg, False, torch.Generator().manual_seed(7))
    assert len(one) == steps_per_epoch(50, cfg, False) == 150 // 16 and all(len(b) == 16 for b in one)
    flat = torch.tensor(one).flatten()
    assert torch.bincount(flat).max() <= 3
    single = TrainConfig(batch_size=16)
    assert [len(b) for b in epoch_batches(50, single, True, torch.Generator())] == [16, 16, 16, 2]
    mixed = epoch_batches(51, single, True, torch.Generator())  # an odd last batch cannot be mixed
    assert [len(b) for b in mixed] == [16, 16, 16] and steps_per_epoch(51, single, True) == 3
