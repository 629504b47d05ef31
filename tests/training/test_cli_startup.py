"""The `barter` command answers `--help` and argument errors without importing torch (what keeps it under a second:
benchmarks/cli_startup.py times it), the packages give their public names on first use as before, and a mistyped
flag is answered with the closest flags."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import barter
import barter.baselines
import barter.training
from barter.training.arguments import unrecognized
from barter.training.cli import main

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "timm", "torchvision", "numpy", "PIL", "fxsurgery", "transformers", "matplotlib", "safetensors")


def modules_after(code: str) -> set[str]:
    """The top-level packages of HEAVY that a fresh interpreter has imported after running `code` (its own output
    dropped)."""
    run = textwrap.indent(textwrap.dedent(code), "    ")
    script = (f"import contextlib, io, sys\nwith contextlib.redirect_stdout(io.StringIO()):\n{run}\n"
              f"print(*sorted({{name.split('.')[0] for name in sys.modules}} & {set(HEAVY)!r}))")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    return set(done.stdout.split())


@pytest.mark.parametrize("argv", [["--help"], ["train", "--help"], ["compare", "--help"], ["export", "--help"],
                                  ["train", "--dnsity", "0.5"], ["train", "--density", "2", "--print-config", "-x"]])
def test_help_and_argument_errors_import_no_torch(argv):
    imported = modules_after(f"""
        from barter.training.cli import main
        try:
            main({argv!r})
        except SystemExit:
            pass
    """)
    assert not imported, f"barter {' '.join(argv)} imported {sorted(imported)} before answering"


def test_the_packages_import_no_torch_until_a_name_is_used():
    assert not modules_after("import barter, barter.training, barter.baselines, barter.training.cli")


@pytest.mark.parametrize("package", [barter, barter.training, barter.baselines], ids=lambda p: p.__name__)
def test_public_names_are_given_on_first_use(package):
    namespace: dict = {}
    exec(f"from {package.__name__} import *", namespace)
    for name in package.__all__:
        value = getattr(package, name)
        assert name in dir(package) and namespace[name] is value
        if callable(value) and hasattr(value, "__module__"):  # defined in the submodule the name comes from
            assert value.__module__.startswith(package.__name__ + ".")
    with pytest.raises(AttributeError, match="has no attribute 'not_a_name'"):
        package.not_a_name  # noqa: B018


def test_names_free_of_torch_match_what_they_name():
    from barter.baselines.registry import BUILDERS
    from barter.method_names import REGISTRY
    from barter.options import METHODS as WRAPPED
    from barter.training.config import AMP_MODES
    from barter.training.precision import DTYPES

    assert tuple(BUILDERS) == barter.baselines.METHODS
    assert tuple(REGISTRY) == ("dense", *WRAPPED, *BUILDERS) == barter.training.METHODS  # one registry names them all
    assert tuple(DTYPES) == AMP_MODES


@pytest.mark.parametrize("argv, typed, suggested", [
    (["train", "--dnsity", "0.5"], "--dnsity", "--density"),
    (["train", "--weight-dacay=0.1"], "--weight-dacay", "--weight-decay"),
    (["train", "--no-progess"], "--no-progess", "--no-progress"),
    (["eval", "runs/x", "--chekpoint", "last"], "--chekpoint", "--checkpoint"),
])
def test_a_mistyped_flag_names_the_closest(capsys, argv, typed, suggested):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert f"usage: barter {argv[0]}" in err  # the sub-command's usage, not the top level's
    assert f"unrecognized arguments: {' '.join(argv[1:]).replace('runs/x ', '')}" in err
    assert f"{typed}: did you mean {suggested}" in err


def test_no_suggestion_without_a_close_flag(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--zzzz", "extra"])
    err = capsys.readouterr().err
    assert "unrecognized arguments: --zzzz extra" in err and "did you mean" not in err
    message = unrecognized(["--dnsity", "3", "-", "--seeed"], ["-h", "--help", "--seed", "--seeds", "--density"])
    assert message.splitlines() == ["unrecognized arguments: --dnsity 3 - --seeed",
                                    "  --dnsity: did you mean --density?", "  --seeed: did you mean --seed or --seeds?"]


@pytest.mark.skipif(sys.version_info < (3, 14), reason="argparse suggests choices from Python 3.14")
def test_a_mistyped_command_names_the_closest_on_python_3_14(capsys):
    with pytest.raises(SystemExit):
        main(["trian"])
    assert "maybe you meant 'train'" in capsys.readouterr().err
