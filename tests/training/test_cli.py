"""The `barter train` command: defaults, overrides, a tiny end-to-end run, resume and continuation flags,
and clear errors for bad input."""
import json
import runpy
import sys

import pytest

from barter.training.cli import build_parser, config_from_args, main

TINY = ["--dataset", "fake", "--fake-size", "32", "--batch-size", "16", "--epochs", "1", "--no-progress",
        "--model", "cct_2_3x1_32_tiny", "--device", "cpu"]


def parse(*argv):
    return config_from_args(build_parser().parse_args(["train", *argv]))


def test_no_arguments_is_the_quick_mnist_preset():
    config, resume = parse()
    assert not resume and config.preset == "mnist5k_quick" and config.dataset == "mnist5k"
    assert config.method == "barter" and config.density == 0.3


def test_overrides():
    config, _ = parse("--preset", "cct_cifar100", "--method", "random_pair", "--density", "0.1", "--epochs", "3",
                      "--seed", "4", "--device", "cpu", "--flop-budget", "1.5e15")
    assert (config.preset, config.method, config.density, config.epochs, config.seed, config.device,
            config.flop_budget) == ("cct_cifar100", "random_pair", 0.1, 3, 4, "cpu", 1.5e15)


def test_tiny_run_then_resume_and_continue(tmp_path, capsys):
    assert main(["train", *TINY, "--out-dir", str(tmp_path), "--name", "run"]) == 0
    assert "test acc" in capsys.readouterr().out
    run = tmp_path / "run"
    assert json.loads((run / "config.json").read_text())["dataset"] == "fake"
    assert main(["train", "--resume", str(run), "--no-progress"]) == 0  # finished: nothing left to train
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 1
    config, resume = parse("--continue-from", str(run), "--flop-budget", str(run))
    assert not resume and config.continue_from == str(run) and config.name is None
    assert config.flop_budget == json.loads((run / "metrics.jsonl").read_text())["flops"]


@pytest.mark.parametrize("argv,message", [
    (["--density", "0"], "density must be in (0, 1]"),
    (["--density", "1.5"], "density must be in (0, 1]"),
    (["--preset", "nope"], "invalid choice: 'nope'"),
    (["--method", "magic"], "invalid choice: 'magic'"),
    (["--epochs", "0"], "must be >= 1"),
    (["--preset", "cct_cifar100", "--data-dir", "/nonexistent/data"], "CIFAR-100 not found"),
    (["--preset", "vit_finetune_cifar100"], "--init-from"),
    (["--resume", "/nonexistent/run"], "not a run directory"),
    (["--flop-budget", "/nonexistent/run"], "neither a number nor a run directory"),
])
def test_bad_input_exits_with_a_message(tmp_path, capsys, argv, message):
    out = [] if "--resume" in argv else ["--out-dir", str(tmp_path)]
    with pytest.raises(SystemExit) as exit_info:
        main(["train", *argv, *out])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_resume_refuses_other_settings(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["train", "--resume", str(tmp_path), "--epochs", "5"])
    assert "only ['device', 'progress', 'workers'] may be overridden" in capsys.readouterr().err


def test_python_dash_m(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["barter", "train", "--density", "2"])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_module("barter", run_name="__main__")
    assert exit_info.value.code == 2 and "density" in capsys.readouterr().err
