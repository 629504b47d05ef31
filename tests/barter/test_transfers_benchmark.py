"""benchmarks/transfers.py on a few fake images: each run appended to transfers.jsonl with its probe-loss jump, the
table pairing the variant with Static, and --resume running only what transfers.jsonl lacks."""
import json
import math

from benchmark_scripts import load_benchmark

TINY = ["--variants", "fade", "--densities", "0.3", "--epochs", "1", "--dataset", "fake", "--threads", "1"]


def test_study_writes_its_runs_and_table_and_resume_runs_only_the_missing(tmp_path, capsys, monkeypatch):
    module = load_benchmark("transfers", monkeypatch)
    out = tmp_path / "study"
    assert module.main([*TINY, "--seeds", "0", "--out", str(out)]) == 0
    lines = [json.loads(line) for line in (out / "transfers.jsonl").read_text().splitlines()]
    assert [(r["variant"], r["density"], r["seed"]) for r in lines] == [("static", 0.3, 0), ("fade", 0.3, 0)]
    static, fade = lines
    assert static["transfers"] == 0 and static["jump"] is None
    assert fade["transfers"] > 0 and math.isfinite(fade["jump"])
    assert static["steps"] == fade["steps"] > 0
    table = (out / "transfers.md").read_text()
    assert table in capsys.readouterr().out
    rows = {line.split(" | ")[0][2:]: line.split(" | ") for line in table.splitlines() if line.startswith("| ")}
    assert rows["static"][6] == "-"  # the reference is not paired with itself
    expected = f"{(fade['acc'] - static['acc']) * 100:+.2f}"
    assert rows["fade"][6] == expected and rows["fade"][7] == expected  # one seed: the difference, no interval
    assert rows["fade"][10] == f"{fade['jump']:+.4f}"

    ran = []
    real = module.run

    def counted(config, variant):
        ran.append((variant, config.seed))
        return real(config, variant)

    monkeypatch.setattr(module, "run", counted)
    assert module.main([*TINY, "--seeds", "0", "1", "--resume", "--out", str(out)]) == 0
    assert ran == [("static", 1), ("fade", 1)]
    assert len((out / "transfers.jsonl").read_text().splitlines()) == 4
    rows = [line for line in (out / "transfers.md").read_text().splitlines() if line.startswith("| fade |")]
    assert len(rows) == 1 and rows[0].split(" | ")[2] == "2"  # both seeds in one row
