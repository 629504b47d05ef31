"""`barter.wrap` on the timm conformance list: one row per model, ending `conformance: <passed>/<total>`.

Columns: heads / channels groups found, exact groups, clone ok (float64, 1e-9), remove ok (equals
masking), train()/eval() like the original, a short training run with transfers, analysis seconds.
Models that take `depth` are built with depth 2 (override with --depth 0 for the listed sizes).
`--all` runs one representative of every timm family with attention (`tests/conformance/timm_families.json`,
rewritten from the installed timm by `--write-families`), at the settings listed there, and ends with
`conformance (all families): <passed>/<total>` and what each failing or skipped family lacks.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "conformance"))  # the test oracle
from conformance_checks import LIST, Conformance, check, model_cases, skipped  # noqa: E402
from timm_families import FAMILIES, write_families  # noqa: E402


def _ok(passed: bool) -> str:
    return "ok" if passed else "FAIL"


def gap(r: Conformance) -> str:
    """Why a model fails the oracle, in a line."""
    if r.error:
        return r.error
    if r.unaccounted:
        more = " ..." if len(r.unaccounted) > 3 else ""
        return f"neither grouped nor reported: {', '.join(r.unaccounted[:3])}{more}"
    if not r.channels:
        return "no FFN channel group: " + ("; ".join(r.left_out[:2]) or "nothing found")
    checks = {"clone": r.clone_ok, "remove": r.remove_ok, "tap": r.tap_ok, "train()/eval()": r.modes_ok,
              "training": r.train_ok, "scores": r.scores_ok}
    return "failed: " + ", ".join(name for name, ok in checks.items() if not ok)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("models", nargs="*", help="only these models")
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--why", action="store_true", help="print what each model leaves out")
    p.add_argument("--list", type=Path, default=LIST,
                   help="JSON list of {model, kwargs} or {model, factory, kwargs, input} (default: the conformance "
                        "list; tests/conformance/timm_models_beyond.json holds timm models that are not on it, "
                        "tests/conformance/models_outside_timm.json torchvision's transformers)")
    p.add_argument("--all", action="store_true", help="one model of every timm family with attention")
    p.add_argument("--write-families", action="store_true", help=f"rewrite {FAMILIES.name} from the installed timm")
    args = p.parse_args()
    if args.write_families:
        write_families()
        return
    path, depth = (FAMILIES, None) if args.all else (args.list, args.depth or None)
    cases = [c for c in model_cases(path, depth=depth) if not args.models or c[0] in args.models]
    print(f"{'model':<34} {'heads':>5} {'chan':>5} {'exact':>5} {'clone':>5} {'remove':>6} {'tap':>4} {'modes':>5} "
          f"{'train':>5} {'score':>5} {'xfers':>5} {'analyse':>8}  note")
    results = []
    for name, build, x in cases:
        r = check(name, build, x)
        results.append(r)
        note = r.error or "; ".join(filter(None, [f"{len(r.left_out)} left out" if r.left_out else "",
                                                  f"unaccounted: {r.unaccounted}" if r.unaccounted else ""]))
        print(f"{name:<34} {r.heads:>5} {r.channels:>5} {r.exact:>5} {_ok(r.clone_ok):>5} {_ok(r.remove_ok):>6} "
              f"{_ok(r.tap_ok):>4} {_ok(r.modes_ok):>5} {_ok(r.train_ok):>5} {_ok(r.scores_ok):>5} {r.transfers:>5} "
              f"{r.analyse_s:>7.1f}s  {note}", flush=True)
        if args.why:
            for lo in r.left_out[:6]:
                print(f"    left out: {lo[:160]}")
    passed = sum(r.passed for r in results)
    if not args.all:
        print(f"conformance: {passed}/{len(cases)}")
        return
    print(f"conformance (all families): {passed}/{len(cases)}")
    for r in results:
        if not r.passed:
            print(f"  gap  {r.model}: {gap(r)}")
    for model, reason in skipped(path):
        print(f"  skip {model}: {reason}")


if __name__ == "__main__":
    main()
