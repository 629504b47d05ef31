"""benchmarks/compress.py end to end in its --quick form: every method compressed to one budget and fine-tuned on
every seed, and the table with its paired differences written."""
import importlib.util
import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch_pruning")
SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "compress.py"


def test_quick_compress_benchmark_writes_its_table(tmp_path, capsys, monkeypatch):
    spec = importlib.util.spec_from_file_location("compress_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    assert module.main(["--quick", "--out", str(tmp_path)]) == 0
    table = (tmp_path / "compress.md").read_text()
    assert table in capsys.readouterr().out
    budget = int(re.search(r"density 0.3 \(([\d,]+) parameters", table).group(1).replace(",", ""))
    main_table, paired_table = table.split("Paired differences")
    rows = {line.split(" | ")[0][2:]: line.split(" | ") for line in main_table.splitlines() if line.startswith("| ")}
    for method in module.METHODS:
        parameters = [int(p.replace(",", "")) for p in rows[method][1].split("/")]
        assert all(budget * 0.9 < p <= budget for p in parameters), (method, parameters)
    assert rows["static"][1] == rows["barter"][1] == f"{budget:,}"  # BARTER's widths set the budget
    assert int(rows["barter"][7]) > 0 and int(rows["static"][7]) == 0  # transfers
    pair = re.compile(r"\| (static|barter) \| (static|tp-\w+) \| [+-]")
    paired = [line for line in paired_table.splitlines() if pair.match(line)]
    assert len(paired) == len(module.PAIRS)
