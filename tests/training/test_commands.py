"""The `barter` subcommands besides train: explain, eval, export and compare, each with an example in --help."""
import json

import pytest

import barter
from barter.training.cli import main

TINY = ["--dataset", "fake", "--fake-size", "32", "--batch-size", "16", "--epochs", "2", "--no-progress",
        "--model", "cct_2_3x1_32_tiny", "--device", "cpu"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    assert main(["train", *TINY, "--out-dir", str(out), "--name", "run"]) == 0
    return out / "run"


@pytest.mark.parametrize("command", ["train", "explain", "eval", "export", "compare"])
def test_help_shows_an_example(capsys, command):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    assert f"barter {command}" in capsys.readouterr().out.split("example")[-1]


def test_explain(capsys):
    assert main(["explain", "cct_2_3x1_32_tiny", "--img-size", "32"]) == 0
    out = capsys.readouterr().out
    assert "head" in out and "channel" in out


def test_eval_matches_the_runs_own_metrics(run_dir, capsys):
    assert main(["eval", str(run_dir), "--checkpoint", "last", "--device", "cpu"]) == 0
    result = json.loads(capsys.readouterr().out)
    last = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][-1]
    assert result["test"]["acc"] == pytest.approx(last["acc"]) and "val" not in result


def test_export_gives_a_loadable_model_without_trainer_state(run_dir, tmp_path, capsys):
    assert main(["export", str(run_dir), str(tmp_path / "model")]) == 0
    assert not (tmp_path / "model" / "trainer.pt").exists()
    exported, best = barter.load(tmp_path / "model"), barter.load(run_dir / "best")
    assert all((a == b).all() for a, b in zip(exported.state_dict().values(), best.state_dict().values()))


@pytest.mark.parametrize("argv,message", [
    (["eval", "/nonexistent/run"], "no best checkpoint"),
    (["export", "/nonexistent/run", "/tmp/x"], "no best checkpoint"),
    (["explain", "no_such_model"], "no_such_model"),
])
def test_bad_input(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_compare_refuses_a_data_dir_its_data_set_does_not_read(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["compare", "--quick", "--data-dir", str(tmp_path), "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2 and "has no train/ and val/ folders" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_compare_writes_table_plot_and_resumes(tmp_path):
    argv = ["compare", "--dataset", "fake", "--methods", "dense", "barter", "--densities", "0.5", "--seeds", "0", "1",
            "--epochs", "1", "--matched-to", "none", "--device", "cpu", "--out", str(tmp_path)]
    assert main(argv) == 0
    assert {"compare.csv", "compare.md", "compare.png", "transfers.png"} <= {p.name for p in tmp_path.iterdir()}
    assert "| barter | 0.5 | 2 |" in (tmp_path / "compare.md").read_text()
    table = (tmp_path / "compare.csv").read_text()
    assert main(argv) == 0  # every run is found finished and read back, not trained again
    assert (tmp_path / "compare.csv").read_text() == table


def test_compare_runs_barter_under_a_named_variant_and_pairs_it_with_static(tmp_path):
    argv = ["compare", "--dataset", "fake", "--methods", "static", "--variants", "count0.5", "--densities", "0.5",
            "--seeds", "0", "--epochs", "1", "--matched-to", "none", "--device", "cpu", "--out", str(tmp_path)]
    assert main(argv) == 0
    run_dir = tmp_path / "runs" / "mnist5k_quick-barter-count0.5-rho0.5-seed0"
    config = json.loads((run_dir / "config.json").read_text())
    assert config["method"] == "barter" and config["barter_options"]["count_scale"] == 0.5
    table = (tmp_path / "compare.md").read_text()
    assert "| barter (count0.5) | 0.5 | 1 |" in table and "| barter (count0.5) | static | 0.5 | 1 |" in table



def test_summary_csv_and_tensorboard(run_dir):
    import csv

    rows = list(csv.DictReader((run_dir / "summary.csv").open()))
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert list(rows[0])[:6] == ["epoch", "train_loss", "eval_loss", "eval_top1", "eval_top5", "lr"]
    assert len(rows) == len(metrics) == 2 and {"macro_f1", "flops", "step", "train_acc"} <= set(rows[0])
    assert float(rows[-1]["eval_top1"]) == pytest.approx(100 * metrics[-1]["acc"])
    assert float(rows[-1]["train_loss"]) == pytest.approx(metrics[-1]["loss"])
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(run_dir / "tensorboard"))
    board.Reload()
    assert [e.step for e in board.Scalars("eval_top1")] == [m["step"] for m in metrics]
