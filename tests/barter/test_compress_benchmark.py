"""benchmarks/compress.py end to end in its --quick form: every method compressed to one budget and fine-tuned on
every seed, and the table with its paired differences written."""
import re

import pytest
from benchmark_scripts import load_benchmark

pytest.importorskip("torch_pruning")


def test_quick_compress_benchmark_writes_its_table(tmp_path, capsys, monkeypatch):
    module = load_benchmark("compress", monkeypatch)
    assert module.main(["--quick", "--out", str(tmp_path)]) == 0
    table, printed = (tmp_path / "compress.md").read_text(), capsys.readouterr().out
    assert table in printed
    assert "dense: epoch 1/1 (" in printed  # the dense model's training shows its epochs
    budget = int(re.search(r"density 0.3 \(([\d,]+) parameters", table).group(1).replace(",", ""))
    main_table, paired_table = table.split("Paired differences")
    rows = {line.split(" | ")[0][2:]: line.split(" | ") for line in main_table.splitlines() if line.startswith("| ")}
    for method in module.METHODS:
        parameters = [int(p.replace(",", "")) for p in rows[method][1].split(";")[0].split("/")]
        assert all(budget * 0.9 < p <= budget for p in parameters), (method, parameters)
    assert rows["static"][1] == rows["barter"][1] == f"{budget:,}"  # BARTER's widths set the budget
    assert int(rows["barter"][7]) > 0 and int(rows["static"][7]) == 0  # transfers
    pair = re.compile(r"\| (static|barter) \| (static|tp-\w+) \| 0, 1 \| [+-]")
    paired = [line for line in paired_table.splitlines() if pair.match(line)]
    assert len(paired) == len(module.pairs_of(list(module.METHODS))) == 5


def test_a_budget_unreachable_at_one_seed_marks_its_row_and_keeps_the_others(tmp_path, monkeypatch):
    module = load_benchmark("compress", monkeypatch)
    real = module.compress_and_tune

    def tight_at_seed_1(method, dense, data, config, setup, seed, density, allocation, budget, kept_heads):
        budget = 10 if (method, seed) == ("tp-magnitude", 1) else budget  # no search reaches 10 parameters
        return real(method, dense, data, config, setup, seed, density, allocation, budget, kept_heads)

    monkeypatch.setattr(module, "compress_and_tune", tight_at_seed_1)
    assert module.main(["--quick", "--out", str(tmp_path)]) == 0
    table = (tmp_path / "compress.md").read_text()
    row = next(line for line in table.splitlines() if line.startswith("| tp-magnitude |"))
    assert "budget not reached at seed 1 (nearest" in row
    for method in ("tp-taylor", "static", "barter"):
        assert "not reached" not in next(line for line in table.splitlines() if line.startswith(f"| {method} |"))
    paired = {tuple(line.split(" | ")[:2]): line.split(" | ") for line in table.split("Paired differences")[1]
              .splitlines() if line.startswith("| ")}
    assert paired["| static", "tp-magnitude"][2] == "0 (seed 1: budget not reached by tp-magnitude)"
    assert re.fullmatch(r"[+-]\d+\.\d+", paired["| static", "tp-magnitude"][3])  # seed 0's difference alone
    assert paired["| static", "tp-taylor"][2] == "0, 1" and len(paired["| static", "tp-taylor"][3].split()) == 2


def test_a_run_cut_after_one_seed_resumes_to_the_uninterrupted_table(tmp_path, monkeypatch):
    module = load_benchmark("compress", monkeypatch)

    def comparable(table):  # the command line and step times differ between runs
        return [line.split(" | ")[:6] for line in table.splitlines()[1:]]

    assert module.main(["--quick", "--out", str(tmp_path / "whole")]) == 0
    real = module.compress_and_tune

    def cut_at_seed_1(method, dense, data, config, setup, seed, *rest):
        if seed == 1:
            raise KeyboardInterrupt
        return real(method, dense, data, config, setup, seed, *rest)

    monkeypatch.setattr(module, "compress_and_tune", cut_at_seed_1)
    with pytest.raises(KeyboardInterrupt):
        module.main(["--quick", "--out", str(tmp_path / "cut")])
    assert len((tmp_path / "cut" / "compress.jsonl").read_text().splitlines()) == 1 + len(module.METHODS)  # settings
    monkeypatch.setattr(module, "compress_and_tune", real)
    whole = comparable((tmp_path / "whole" / "compress.md").read_text())
    assert module.main(["--quick", "--resume", "--out", str(tmp_path / "cut")]) == 0
    assert comparable((tmp_path / "cut" / "compress.md").read_text()) == whole
    # a resume naming fewer seeds runs nothing and still reports every finished seed
    assert module.main(["--quick", "--resume", "--seeds", "0", "--out", str(tmp_path / "cut")]) == 0
    assert comparable((tmp_path / "cut" / "compress.md").read_text()) == whole


def test_a_budget_the_recipes_head_grid_steps_over_is_reached_with_the_finer_grid(monkeypatch):
    """Three layers of three heads and a target of three heads: the 4-point head grid keeps four heads at best
    (torch-pruning leaves a layer whole), too many for the budget at any channel ratio; the finer grid keeps three."""
    module = load_benchmark("compress", monkeypatch)
    from barter.rebuild import timm_with_models

    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    dense = timm_with_models().create_model("vit_tiny_patch16_224", num_classes=3, in_chans=1, img_size=8,
                                            embed_dim=24, depth=3, num_heads=3, mlp_ratio=2.0, patch_size=4)
    example = torch.randn(2, 1, 8, 8)

    def pruned(ratio, head_ratio):
        return module.tp_pruned(dense, example, ratio=ratio, head_ratio=head_ratio, importance="magnitude",
                                calibration=[])

    coarse = [sum(module.widths(pruned(0.5, k / 4))[0]) for k in range(1, 4)]
    assert 3 not in coarse and min(abs(h - 3) for h in coarse) == 1  # the form's grid cannot keep three heads
    closest = min((abs(h - 3), k / 4) for k, h in enumerate(coarse, start=1))[1]
    budget = module.parameters(pruned(0.95, 9 / 16))  # three heads, one per layer, from the 16-point grid
    assert budget < min(module.parameters(pruned(top, closest)) for top in (0.95, 0.99))
    model, search = module.tp_within_budget(dense, example, budget, 3, "magnitude", [], (4, 6))
    assert module.parameters(model) <= budget and sum(module.widths(model)[0]) == 3
    assert search == "global, 16-point head grid, ratio <= 0.95"
    with pytest.raises(module.BudgetUnreachable):  # the order: without the finer grid, only uniform pruning is left
        monkeypatch.setattr(module, "SEARCHES", module.SEARCHES[:2])
        module.tp_within_budget(dense, example, budget, 3, "magnitude", [], (4, 6))


def test_resume_refuses_a_rerun_whose_settings_or_dense_model_differ_and_names_the_setting(tmp_path, monkeypatch,
                                                                                          capsys):
    module = load_benchmark("compress", monkeypatch)
    torch = pytest.importorskip("torch")

    def cut(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(module, "compress_and_tune", cut)
    with pytest.raises(KeyboardInterrupt):
        module.main(["--quick", "--out", str(tmp_path)])
    log = tmp_path / "compress.jsonl"
    written = log.read_text()
    assert '"density": 0.3' in written and '"dense_sha256": "' in written
    capsys.readouterr()
    for flags, setting in ((["--quick", "--density", "0.5"], "density"), (["--quick", "--allocation", "global"],
                                                                          "allocation"), ([], "form"),
                           (["--quick", "--variants", "fade"], "variants"),
                           (["--quick", "--methods", "static", "barter"], "methods")):
        with pytest.raises(SystemExit) as exit_:
            module.main([*flags, "--resume", "--out", str(tmp_path)])
        assert exit_.value.code == 2 and f"were run with {setting} " in capsys.readouterr().err, setting
        assert log.read_text() == written
    weights = torch.load(tmp_path / "dense" / "dense.pt", weights_only=True)
    weights["head.bias"] += 1  # another dense model, with a manifest of its own: the files check passes
    torch.save(weights, tmp_path / "dense" / "dense.pt")
    module.write_manifest(tmp_path / "dense")
    with pytest.raises(SystemExit):
        module.main(["--quick", "--resume", "--out", str(tmp_path)])
    assert "were run with dense_sha256 " in capsys.readouterr().err and log.read_text() == written


def test_variants_run_barter_under_their_named_options_each_paired_with_static(tmp_path, capsys, monkeypatch):
    """--methods static --variants paper count0.5 fade: no torch-pruning row; each variant's row wraps with its
    options (seen at the wrap and in the table: half the counts make fewer transfers) and is paired with Static."""
    module = load_benchmark("compress", monkeypatch)
    real, wrapped = module.barter.wrap, []

    def recording(*args, **kwargs):
        wrapped.append((kwargs["method"], {k: kwargs[k] for k in ("transfer_policy", "count_scale", "removal")
                                           if k in kwargs}))
        return real(*args, **kwargs)

    monkeypatch.setattr(module.barter, "wrap", recording)
    flags = ["--quick", "--methods", "static", "--variants", "paper", "count0.5", "fade", "--seeds", "0"]
    assert module.main([*flags, "--out", str(tmp_path)]) == 0
    assert wrapped[1:] == [("static", {}), ("barter", {"transfer_policy": "paper"}), ("barter", {"count_scale": 0.5}),
                           ("barter", {"removal": "fade"})]  # after the budget's probe
    table = (tmp_path / "compress.md").read_text()
    main_table, paired_table = table.split("Paired differences")
    rows = {line.split(" | ")[0][2:]: line.split(" | ") for line in body_rows(main_table)}
    assert list(rows) == ["static", "barter (paper)", "barter (count0.5)", "barter (fade)"]
    assert 0 < int(rows["barter (count0.5)"][7]) < int(rows["barter (paper)"][7])
    paired = [line.split(" | ")[:3] for line in body_rows(paired_table)]
    assert paired == [[f"| barter ({v})", "static", "0"] for v in ("paper", "count0.5", "fade")]
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:  # a variant's reference is Static
        module.main(["--quick", "--methods", "barter", "--variants", "fade", "--out", str(tmp_path / "none")])
    assert exit_.value.code == 2 and "add it to --methods" in capsys.readouterr().err


def body_rows(table: str) -> list[str]:
    """A markdown table's rows below its header."""
    return [line for line in table.splitlines() if line.startswith("| ")][1:]
