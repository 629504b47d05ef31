"""`barter train --model-ema`: timm's EMA of the weights follows the transfers, is evaluated beside the model,
selects the best checkpoint, is what best/ and last/ export, and resumes exactly."""
import copy
import csv

import pytest
import torch
from interrupted import cut_and_resume

import barter
import barter.training.loop as loop_module
from barter.training import ConfigError, TrainConfig, train
from barter.training.cli import build_parser, config_from_args
from barter.training.runlog import RunDir, load_checkpoint


def config(tmp_path, name, **kw):
    """Two epochs of 4 steps of the paper's ViT (64 fake images, batch 16), transfers inside the window."""
    base = {"dataset": "fake", "fake_size": 64, "batch_size": 16, "epochs": 2, "lr": 2e-3, "warmup_epochs": 0.5,
            "device": "cpu", "out_dir": str(tmp_path), "progress": False, "density": 0.5, "method": "barter",
            "model": "vit_paper_p8_64_tiny", "img_size": 16, "model_kwargs": {"patch_size": 4},
            "barter_options": {"window": (0.1, 0.9)}, "model_ema": 0.9}
    return TrainConfig(**{**base, "name": name, **kw})


def assert_equal_states(a, b):
    assert a.keys() == b.keys()
    for name, tensor in a.items():
        assert torch.equal(tensor, b[name]), name


def test_model_ema_resumes_exactly_and_exports_the_ema(tmp_path, monkeypatch):
    """An uninterrupted run against one cut in the second epoch's evaluation and resumed: same events, live
    weights, EMA weights, optimizer and metrics; best/ loads as the EMA of its epoch."""
    real_save, saved_emas = loop_module.save_checkpoints, {}

    def keep_ema(session, *args, **kwargs):
        saved_emas[session.epoch] = copy.deepcopy(session.ema.module)
        return real_save(session, *args, **kwargs)

    monkeypatch.setattr(loop_module, "save_checkpoints", keep_ema)
    whole = train(config(tmp_path, "whole"))
    # the model's and the EMA's test evaluations run per epoch: the third is in the second epoch
    resumed = cut_and_resume(monkeypatch, config(tmp_path, "cut"), crash_at=3)

    a, b = load_checkpoint(whole.run_dir / "last"), load_checkpoint(resumed.run_dir / "last")
    assert a["controller"]["events"] == b["controller"]["events"]
    assert any(e["step"] > 4 and e["skipped"] is None for e in a["controller"]["events"])  # after the cut
    for key in ("model", "live_model", "model_ema"):
        assert_equal_states(a[key], b[key])
    for key, state in a["optimizer"]["state"].items():
        assert all(torch.equal(v, b["optimizer"]["state"][key][k]) for k, v in state.items())
    metrics = RunDir(whole.run_dir).metrics()
    assert metrics == [{**m, "wall_s": w["wall_s"]} for m, w in zip(RunDir(resumed.run_dir).metrics(), metrics)]

    # the export holds the EMA's weights (the live model's are elsewhere), and the EMA selects the best epoch
    assert_equal_states(a["model"], {k.removeprefix("module."): v for k, v in a["model_ema"].items()})
    assert any(not torch.equal(v, a["live_model"][k]) for k, v in a["model"].items())
    assert {"ema_test_acc", "ema_test_loss", "ema_test_top5", "ema_test_macro_f1"} <= set(metrics[-1])
    assert a["best"]["acc"] == max(m["ema_test_acc"] for m in metrics) == whole.best_acc
    with (whole.run_dir / "summary.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [float(r["eval_top1"]) for r in rows] == pytest.approx([100 * m["acc"] for m in metrics])
    assert [float(r["ema_eval_top1"]) for r in rows] == pytest.approx([100 * m["ema_test_acc"] for m in metrics])

    images = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    for checkpoint in ("best", "last"):
        loaded = barter.load(whole.run_dir / checkpoint).eval()
        ema = saved_emas[load_checkpoint(whole.run_dir / checkpoint)["epoch"]].eval()
        with torch.no_grad():
            assert torch.equal(loaded(images), ema(images)), checkpoint


@pytest.mark.parametrize("method", ["dense", "rigl"])
def test_model_ema_of_unwrapped_methods(tmp_path, method):
    result = train(config(tmp_path, method, method=method, epochs=1, barter_options={}))
    state = load_checkpoint(result.run_dir / "last")
    assert_equal_states(state["model"], {k.removeprefix("module."): v for k, v in state["model_ema"].items()})
    assert "ema_test_acc" in RunDir(result.run_dir).metrics()[-1]


def test_model_ema_flag_and_range(tmp_path):
    args = build_parser().parse_args(["train", "--model-ema", "0.999"])
    assert config_from_args(args)[0].model_ema == 0.999
    for decay in (0.0, 1.0, 1.5):
        with pytest.raises(ConfigError, match="model_ema must be in"):
            train(config(tmp_path, "bad", model_ema=decay))
