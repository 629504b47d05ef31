"""`barter.wrap` on the timm conformance list: one row per model, ending `conformance: <passed>/<total>`.

Columns: heads / channels groups found, exact groups, clone ok (float64, 1e-9), remove ok (equals
masking), train()/eval() like the original, a short training run with transfers, analysis seconds.
Models that take `depth` are built with depth 2 (override with --depth 0 for the listed sizes).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "conformance"))  # the test oracle
from conformance_checks import LIST, check, model_cases  # noqa: E402


def _ok(passed: bool) -> str:
    return "ok" if passed else "FAIL"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("models", nargs="*", help="only these models")
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--why", action="store_true", help="print what each model leaves out")
    p.add_argument("--list", type=Path, default=LIST,
                   help="JSON list of {model, kwargs} or {model, factory, kwargs, input} (default: the conformance "
                        "list; tests/conformance/timm_models_beyond.json holds timm models that are not on it, "
                        "tests/conformance/models_outside_timm.json torchvision's transformers)")
    args = p.parse_args()
    cases = [c for c in model_cases(args.list, depth=args.depth or None) if not args.models or c[0] in args.models]
    print(f"{'model':<34} {'heads':>5} {'chan':>5} {'exact':>5} {'clone':>5} {'remove':>6} {'modes':>5} "
          f"{'train':>5} {'xfers':>5} {'analyse':>8}  note")
    passed = 0
    for name, build, x in cases:
        r = check(name, build, x)
        passed += r.passed
        note = r.error or "; ".join(filter(None, [f"{len(r.left_out)} left out" if r.left_out else "",
                                                  f"unaccounted: {r.unaccounted}" if r.unaccounted else ""]))
        print(f"{name:<34} {r.heads:>5} {r.channels:>5} {r.exact:>5} {_ok(r.clone_ok):>5} {_ok(r.remove_ok):>6} "
              f"{_ok(r.modes_ok):>5} {_ok(r.train_ok):>5} {r.transfers:>5} {r.analyse_s:>7.1f}s  {note}", flush=True)
        if args.why:
            for lo in r.left_out[:6]:
                print(f"    left out: {lo[:160]}")
    print(f"conformance: {passed}/{len(cases)}")


if __name__ == "__main__":
    main()
