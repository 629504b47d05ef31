"""The README's timm families table is what `benchmarks/conformance.py --all` computes: each row's model, its head /
FFN group counts and its pass/fail agree with the oracle run on the same model (tests/conformance/timm_families.json).
`make conformance` compares every row (one oracle run each: too slow for `make test`, so every row is `slow`).
`make test` compares the head / FFN group counts of a fast subset of rows (the oracle's analysis alone)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
from conformance_checks import check, model_cases

README = Path(__file__).resolve().parents[2] / "README.md"
FAMILIES = Path(__file__).parent / "timm_families.json"
# the families whose analysis takes under 2 s on 2 shared cores, and ConViT (12 s), SAM-ViT (3 s), EfficientViT-M
# (19 s) and CoaT (18 s on one core shared with another run)
FAST = {"deit", "vision_transformer", "vision_transformer_relpos", "eva", "tnt", "cait", "convit",
        "vision_transformer_sam", "efficientvit_msra", "coat"}
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


def cases(families: set[str] | None = None):
    """A row per family (of ``families`` only, when given): (model, its builder and input, its claimed cells)."""
    by_model = {name: (build, x) for name, build, x in model_cases(FAMILIES, depth=None)}
    for family, (model, heads, channels, passes) in table_rows().items():
        if families is None or family in families:
            yield pytest.param(model, by_model.get(model), (heads, channels, passes), id=family,
                               marks=[] if families else [pytest.mark.slow])


def test_the_table_lists_every_family() -> None:
    assert len(table_rows()) == len(model_cases(FAMILIES, depth=None))


@pytest.mark.parametrize("model, case, claimed", list(cases()))
def test_a_table_row_is_what_the_oracle_computes(model, case, claimed) -> None:
    assert case is not None, f"{model} is in the README's table but not in {FAMILIES.name}"
    build, x = case
    r = check(model, build, x)
    assert (r.heads, r.channels, r.passed) == claimed, r.error or r.left_out


def test_the_fast_rows_are_families_of_the_table() -> None:
    assert FAST <= set(table_rows())


@pytest.mark.parametrize("model, case, claimed", list(cases(FAST)))
def test_a_fast_rows_group_counts_are_what_the_analysis_finds(model, case, claimed) -> None:
    assert case is not None, f"{model} is in the README's table but not in {FAMILIES.name}"
    r = check(model, *case, analysis_only=True)
    assert (r.heads, r.channels) == claimed[:2], r.error or r.left_out
