"""The project's models live under `barter.models`, so a user's own top-level `models` package still imports
next to barter (run in a fresh interpreter, so no import cache from this one leaks in)."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout, whose barter is the one under test


def test_users_models_package_and_barter_models_both_import(tmp_path):
    user = tmp_path / "models"
    user.mkdir()
    (user / "__init__.py").write_text("")
    (user / "mine.py").write_text("NAME = 'the user model'\n")
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); "
            "import barter; from barter.rebuild import timm_with_models; timm = timm_with_models(); "
            "import barter.models, models, models.mine; "
            "print(json.dumps({'user': models.mine.NAME, 'file': models.__file__, "
            "'registered': sorted(timm.list_models(['cct_*', 'vit_paper_*'])), "
            "'built': type(timm.create_model('cct_2_3x1_32_tiny')).__module__}))")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["user"] == "the user model" and Path(result["file"]).parent == user
    assert {"cct_2_3x1_32_tiny", "cct_7_3x1_32", "vit_paper_p8_64", "vit_paper_p8_64_tiny"} <= set(result["registered"])
    assert result["built"] == "barter.models.cct"
