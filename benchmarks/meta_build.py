"""Builds on the meta device replayed (`barter.meta_build`) against the same builds on the CPU, over the timm
conformance list: one row per model, ending `meta build: <equal>/<total> bit-equal, <refused> refused`.

A row builds the model on the CPU from seed 0, then on meta from seed 0 (recorded), materialises it, and compares
every parameter and buffer bit for bit, and the generator's state after (the replay draws what the build drew). A build
that cannot run on meta is refused with its reason (it reads a value it drew); a replay that differs is a failure.

    python benchmarks/meta_build.py [--models vit_tiny_patch16_224,hiera_tiny_224]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path
from typing import NamedTuple

import torch

LIST = Path(__file__).resolve().parents[1] / "tests" / "conformance" / "timm_models.json"


class Row(NamedTuple):
    model: str
    outcome: str  # "equal", "refused" or "differs"
    detail: str
    seconds: float


def replayed_row(name: str, kwargs: dict) -> Row:
    """The model built on meta and replayed, against its build on the CPU."""
    import timm

    from barter.meta_build import MetaBuildError, materialise, record_build

    start = time.perf_counter()
    torch.manual_seed(0)
    expected = timm.create_model(name, **kwargs).state_dict()
    after = torch.get_rng_state()
    torch.manual_seed(0)
    try:
        model, record = record_build(lambda: timm.create_model(name, **kwargs))
    except MetaBuildError as e:
        return Row(name, "refused", str(e), time.perf_counter() - start)
    materialise(model, record, torch.device("cpu"))
    values = model.state_dict()
    unequal = [key for key, value in expected.items() if not torch.equal(values[key], value)]
    if not torch.equal(torch.get_rng_state(), after):
        unequal.append("(the generator's state)")
    detail = f"{len(record.ops)} ops replayed" if not unequal else f"differs at {unequal[:3]} ({len(unequal)})"
    return Row(name, "differs" if unequal else "equal", detail, time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=None, help="comma-separated models of the list (default: all)")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    entries = json.loads(LIST.read_text())
    if args.models:
        wanted = args.models.split(",")
        entries = [e for e in entries if e["model"] in wanted]
    rows = [replayed_row(e["model"], e.get("kwargs", {})) for e in entries]
    for row in rows:
        print(f"{row.model:34s} {row.outcome:8s} {row.seconds:6.1f} s  {row.detail}")
    equal, refused = (sum(row.outcome == outcome for row in rows) for outcome in ("equal", "refused"))
    print(f"meta build: {equal}/{len(rows)} bit-equal, {refused} refused")
    return 0 if equal + refused == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
