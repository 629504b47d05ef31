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


def test_every_config_field_is_a_flag():
    from dataclasses import fields

    from barter.training.config import FIELD_HELP, TrainConfig

    parser = build_parser()
    train_flags = {option for action in parser._subparsers._group_actions[0].choices["train"]._actions
                   for option in action.option_strings}
    names = {f.name for f in fields(TrainConfig)}
    assert {"--" + name.replace("_", "-") for name in names} <= train_flags
    assert set(FIELD_HELP) <= names
    assert {"--beta", "--window", "--head-ratio", "--noise-std", "--no-noise-relative", "--init"} <= train_flags


def test_config_file_then_flags(tmp_path, capsys):
    (tmp_path / "c.yaml").write_text("preset: cct_cifar100\nlr: 1e-4\nweight_decay: 0.2\n"
                                     "model_kwargs: {drop_rate: 0.1}\nbarter_options: {beta: 0.9}\n")
    config, _ = parse("-c", str(tmp_path / "c.yaml"), "--weight-decay", "0.3", "--window", "0.2", "0.5",
                      "--img-size", "none", "--no-progress", "--label-smoothing", "0")
    assert (config.preset, config.epochs, config.lr, config.weight_decay) == ("cct_cifar100", 300, 1e-4, 0.3)
    assert config.model_kwargs == {"drop_rate": 0.1} and config.img_size is None and config.progress is False
    assert config.barter_options == {"beta": 0.9, "window": (0.2, 0.5)} and config.label_smoothing == 0.0
    (tmp_path / "c.json").write_text(json.dumps({"preset": "custom", "epochs": 2}))
    config, _ = parse("-c", str(tmp_path / "c.json"))
    assert (config.preset, config.epochs, config.dataset) == ("custom", 2, "fake")
    assert main(["train", "-c", str(tmp_path / "c.yaml"), "--seed", "7", "--print-config"]) == 0
    printed = capsys.readouterr().out
    assert "seed: 7\n" in printed and "lr: 0.0001\n" in printed and "weight_decay: 0.2\n" in printed


def test_transfer_policy_flags_and_file_entries_become_wrap_options(tmp_path, capsys):
    config, _ = parse("--transfer-policy", "paper", "--transfer-parts", "clones", "--count-scale", "2",
                      "--clone-state", "restart", "--removal", "fade", "--window", "0.2", "0.6")
    assert config.barter_options == {"transfer_policy": "paper", "transfer_parts": "clones", "count_scale": 2.0,
                                     "clone_state": "restart", "removal": "fade", "window": (0.2, 0.6)}
    config.validate()
    (tmp_path / "c.yaml").write_text("barter_options: {clone_state: carry, removal: paper}\n")
    config, _ = parse("-c", str(tmp_path / "c.yaml"), "--count-scale", "0.5")
    assert config.barter_options == {"clone_state": "carry", "removal": "paper", "count_scale": 0.5}
    assert main(["train", "-c", str(tmp_path / "c.yaml"), "--print-config"]) == 0
    assert "clone_state: carry\n" in capsys.readouterr().out


@pytest.mark.parametrize("text,message", [
    ("barter_options: {clone_state: fresh}\n", "barter_options.clone_state: must be one of 'paper', 'carry', "
                                               "'restart', got 'fresh'"),
    ("lrr: 1\n", "unknown config field(s): lrr"),
    ("epochs: many\n", "epochs: expected an integer, got 'many'"),
    ("barter_options: {betta: 0.9}\n", "barter_options: unknown option(s) betta"),
    ("barter_options: {window: [0.5]}\n", "barter_options.window: expected 2 values"),
    ("- 1\n", "must hold a mapping"),
    ("{a: [\n", "is not valid YAML"),
])
def test_bad_config_file_names_the_field(tmp_path, capsys, text, message):
    (tmp_path / "c.yaml").write_text(text)
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "-c", str(tmp_path / "c.yaml")])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["--lr", "fast"], "lr: expected a number, got 'fast'"),
    (["--drop-last", "--model-kwargs", "[1]"], "model_kwargs: expected a mapping"),
    (["--beta", "1.5"], "beta must be in [0, 1)"),
    (["--window", "0.1"], "barter_options.window: expected 2 values"),
    (["--count-scale", "0"], "count_scale multiplies the transfer counts: it must be a number > 0, got 0"),
    (["--removal", "slow"], "argument --removal: invalid choice: 'slow'"),
])
def test_bad_flag_values_name_the_field(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", *argv])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_train_on_an_image_folder(tmp_path, capsys):
    from PIL import Image

    for split, n in (("train", 4), ("val", 2)):
        for c, name in enumerate(("ant", "bee", "cow")):
            (tmp_path / "data" / split / name).mkdir(parents=True)
            for i in range(n):
                Image.new("RGB", (32, 32), (80 * c, 20 * i, 0)).save(tmp_path / "data" / split / name / f"{i}.png")
    argv = [*TINY, "--dataset", "folder", "--data-dir", str(tmp_path / "data"), "--out-dir", str(tmp_path / "runs"),
            "--name", "run", "--batch-size", "6", "--recipe", "none"]
    assert main(["train", *argv]) == 0
    weights = (tmp_path / "runs" / "run" / "best" / "topology.json").read_text()
    assert json.loads(weights)["model_kwargs"]["num_classes"] == 3
