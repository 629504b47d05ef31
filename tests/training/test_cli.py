"""The `barter train` command: defaults, overrides, a tiny end-to-end run, resume and continuation flags,
and clear errors for bad input."""
import json
import runpy
import sys

import pytest

from barter.training.cli import build_parser, config_from_args, main

TINY = ["--dataset", "fake", "--fake-size", "32", "--batch-size", "16", "--epochs", "1", "--no-progress",
        "--model", "cct_2_3x1_32_tiny", "--device", "cpu"]


def image_tree(root, sizes, val=1, mode="RGB"):
    """root/train/<class>/<i>.png of the given (width, height) per class, and `val` 4x4 images per class in val/."""
    from PIL import Image

    for c, (name, shapes) in enumerate(sizes.items()):
        for split, split_shapes in (("train", shapes), ("val", [(4, 4)] * val)):
            (root / split / name).mkdir(parents=True, exist_ok=True)
            for i, shape in enumerate(split_shapes):
                Image.new(mode, shape, (80 * c, 20 * i, 0) if mode == "RGB" else 80 * c).save(
                    root / split / name / f"{i}.png")
    return root


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
    assert main(["train", *TINY, "--progress", "--out-dir", str(tmp_path), "--name", "run"]) == 0
    out, err = capsys.readouterr()
    assert "test acc" in out and "\r" not in out + err  # not a terminal: plain lines, no progress bar
    assert [line for line in out.splitlines() if line.startswith("epoch ")][0].startswith("epoch 1: loss ")
    run = tmp_path / "run"
    assert json.loads((run / "config.json").read_text())["dataset"] == "fake"
    files = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in run.rglob("*") if p.is_file()}
    assert main(["train", "--resume", str(run), "--no-progress"]) == 0  # finished: nothing left to train
    assert f"{run} has finished (epoch 1): nothing to resume, no file changed" in capsys.readouterr().out
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in run.rglob("*") if p.is_file()} == files
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
    (["--resume", "/nonexistent/run"], "/nonexistent/run does not exist"),
    (["--data-dir", "/nonexistent/data"], "has no train/ and val/ folders"),
    (["--dataset", "fake", "--data-dir", "/nonexistent/data"], "pass --dataset folder"),
    (["--flop-budget", "/nonexistent/run"], "neither a number nor a run directory"),
])
def test_bad_input_exits_with_a_message(tmp_path, capsys, argv, message):
    out = [] if "--resume" in argv else ["--out-dir", str(tmp_path)]
    with pytest.raises(SystemExit) as exit_info:
        main(["train", *argv, *out])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_resume_of_a_directory_that_is_no_run(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["train", "--resume", str(tmp_path)])
    assert "is not a run directory (no config.json)" in capsys.readouterr().err


def test_data_dir_of_an_image_tree_is_the_folder_data_set(tmp_path, capsys):
    image_tree(tmp_path, {"ant": [(8, 8)], "bee": [(8, 8)]})
    config, _ = parse("--data-dir", str(tmp_path))
    assert (config.dataset, config.data_dir, config.img_size) == ("folder", str(tmp_path), None)
    assert "training on that image folder (--dataset folder)" in capsys.readouterr().err
    config, _ = parse("--data-dir", str(tmp_path), "--img-size", "24")
    assert (config.dataset, config.img_size) == ("folder", 24)
    config, _ = parse("--preset", "cct_cifar100", "--data-dir", str(tmp_path))
    assert config.dataset == "cifar100"  # a data set that reads data_dir keeps it


def test_train_on_an_image_folder_of_mixed_sizes_says_what_it_trains(tmp_path, capsys):
    from barter import load

    image_tree(tmp_path / "data", {"ant": [(6, 6), (16, 16), (16, 16)], "bee": [(16, 16), (16, 16), (16, 16)]})
    argv = ["--preset", "custom", "--data-dir", str(tmp_path / "data"), "--batch-size", "6", "--epochs", "1",
            "--no-progress", "--device", "cpu", "--recipe", "none", "--out-dir", str(tmp_path / "runs"),
            "--name", "run"]
    assert main(["train", *argv]) == 0
    out = capsys.readouterr().out
    header = dict(line.split(":", 1) for line in out.splitlines()[:6])
    assert header["data"].strip() == f"image folder at {tmp_path / 'data'}: 6 training and 2 test images"
    assert header["classes"].strip() == "2 (ant, bee)"
    assert header["images"].startswith("  16x16 px, 3 channels; 2 image sizes among the 6 read (16x16: 5, 6x6: 1)")
    model = load(tmp_path / "runs" / "run" / "best")
    parameters = sum(p.numel() for p in model.parameters())
    assert header["model"].strip() == f"cct_2_3x1_32_tiny, {parameters:,} parameters"
    assert header["method"].strip().startswith("barter, density 0.3; starting widths per layer | heads ")
    assert header["run"].strip() == str(tmp_path / "runs" / "run")
    topology = json.loads((tmp_path / "runs" / "run" / "best" / "topology.json").read_text())
    assert topology["model_kwargs"]["img_size"] == 16 and topology["model_kwargs"]["num_classes"] == 2


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
