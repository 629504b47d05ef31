"""The README's timm families table is what `benchmarks/conformance.py --all` computes: each row's model, its head /
FFN group counts and its pass/fail agree with the oracle run on the same model (tests/conformance/timm_families.json).
`make conformance` compares every row (one oracle run each: too slow for `make test`, so every row is `slow`)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
from conformance_checks import check, model_cases

README = Path(__file__).resolve().parents[2] / "README.md"
FAMILIES = Path(__file__).parent / "timm_families.json"
ROW = re.compile(r"^\| (\w+) \| `([\w.]+)`[^|]*\| (\d+) / (\d+) \| (pass|fail)")


def table_rows() -> dict[str, tuple[str, int, int, bool]]:
    """The families table of the README: family -> (model, heads, FFN groups, passes)."""
    text = README.read_text().split("### timm families", 1)[1]
    rows = {}
    for line in text.splitlines():
        if match := ROW.match(line):
            family, model, heads, channels, result = match.groups()
            rows[family] = (model, int(heads), int(channels), result == "pass")
    return rows


def cases():
    by_model = {name: (build, x) for name, build, x in model_cases(FAMILIES, depth=None)}
    for family, (model, heads, channels, passes) in table_rows().items():
        yield pytest.param(model, by_model.get(model), (heads, channels, passes), id=family, marks=[pytest.mark.slow])


def test_the_table_lists_every_family() -> None:
    assert len(table_rows()) == len(model_cases(FAMILIES, depth=None))


@pytest.mark.parametrize("model, case, claimed", list(cases()))
def test_a_table_row_is_what_the_oracle_computes(model, case, claimed) -> None:
    assert case is not None, f"{model} is in the README's table but not in {FAMILIES.name}"
    build, x = case
    r = check(model, build, x)
    assert (r.heads, r.channels, r.passed) == claimed, r.error or r.left_out
