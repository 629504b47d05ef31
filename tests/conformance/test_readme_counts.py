"""The counts the README states about its conformance lists are those of the lists the conformance tests run
(tests/test_conformance.py and tests/conformance/test_families_table.py): the families total is the families
table's rows and its passes, the Hugging Face row's total is models_hugging_face.json, and the vit-pytorch and
open_clip rows name one model per entry of models_einops_open_clip.json."""
from __future__ import annotations

import json
import re
from pathlib import Path

from test_families_table import table_rows

HERE = Path(__file__).parent
README = HERE.parents[1] / "README.md"


def library_rows() -> dict[str, list[tuple[str, str]]]:
    """The rows of the README's library table: library name (without version) -> its (models, result) cells."""
    rows: dict[str, list[tuple[str, str]]] = {}
    text = README.read_text().split("### Beyond symbolic tracing", 1)[1].split("### timm families", 1)[0]
    for line in text.splitlines():
        if match := re.match(r"^\| ([\w_-]+) [\d.]+ \| (.+) \| (.+) \|$", line):
            rows.setdefault(match[1], []).append((match[2], match[3]))
    return rows


def named_models(cell: str) -> list[str]:
    """The models a cell names: comma-separated, or joined by "and", parentheses aside."""
    flat = re.sub(r"\([^()]*\)", "", cell)
    return [name.strip(" `") for part in flat.split(",") for name in part.split(" and ") if name.strip(" `")]


def test_the_families_total_is_the_tables() -> None:
    passed, total = map(int, re.search(r"`conformance \(all families\): (\d+)/(\d+)`", README.read_text()).groups())
    rows = table_rows()
    assert total == len(rows) == len(json.loads((HERE / "timm_families.json").read_text()))
    assert passed == sum(passes for *_, passes in rows.values())


def test_the_hugging_face_total_is_its_list() -> None:
    [(_, result)] = library_rows()["transformers"]
    passed, total = map(int, re.match(r"(\d+)/(\d+) conformance", result).groups())
    assert passed == total == len(json.loads((HERE / "models_hugging_face.json").read_text()))


def test_the_other_libraries_name_one_model_per_entry_of_their_list() -> None:
    rows = library_rows()
    named = [name for library in ("vit-pytorch", "open_clip") for models, _ in rows[library]
             for name in named_models(models)]
    assert len(named) == len(json.loads((HERE / "models_einops_open_clip.json").read_text())), named
