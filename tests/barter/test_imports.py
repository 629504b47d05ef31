"""`import barter` loads the method only: no timm, no project models, no safetensors (those load lazily, when an
export or a load first needs them), and the public names are the functions and classes, not their modules."""
import json
import subprocess
import sys
import types
from pathlib import Path

HEAVY = ("timm.", "barter.models.", "safetensors.")  # a module is heavy when it or its package starts so
ROOT = Path(__file__).resolve().parents[2]  # the checkout, whose barter is the one under test


def test_import_barter_loads_no_timm_models_or_safetensors():
    code = ("import json, sys, barter; "
            f"print(json.dumps(sorted(m for m in sys.modules if (m + '.').startswith({HEAVY!r}))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_public_names_are_not_shadowed_modules():
    import barter

    for name in ("wrap", "export", "load"):
        assert callable(getattr(barter, name)) and not isinstance(getattr(barter, name), types.ModuleType), name
    assert isinstance(barter.ExportError, type) and issubclass(barter.ExportError, ValueError)
    assert isinstance(barter.Controller, type) and isinstance(barter.DistributedModel, type)
