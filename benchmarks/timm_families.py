"""One representative of every timm architecture family with attention, written to
`tests/conformance/timm_families.json` (`python benchmarks/conformance.py --write-families`).

A family is a module under `timm.models`. It has attention when one of its models, built on the meta
device, holds a module the oracle counts as attention (`UNIT_MODULES["head"]`). Its representative is the
attention model with the fewest parameters, built at the smallest settings it accepts (depth 2, then
the default depth; 64-pixel images, then larger up to the model's own) and checked by one forward pass on the CPU.
No weights are loaded; a family none of whose models builds is listed with the reason it was skipped.
"""
from __future__ import annotations

import json
import warnings
from collections import defaultdict
from pathlib import Path
from typing import NamedTuple

import torch
from conformance_checks import UNIT_MODULES, timm_model

FAMILIES = Path(__file__).resolve().parents[1] / "tests" / "conformance" / "timm_families.json"
SIZES = (64, 96, 128)  # image sides tried, smallest first, before the model's own
CANDIDATES = 3  # models tried per family, fewest parameters first


class Profile(NamedTuple):
    """A model as built on the meta device: its parameter count and the attention classes it holds."""

    name: str
    params: int
    attention: tuple[str, ...]


class Build(NamedTuple):
    """Settings at which a model builds and runs a forward pass."""

    kwargs: dict
    side: int


def families() -> dict[str, list[str]]:
    """timm's registered models grouped by the `timm.models` module that defines them."""
    import timm
    from timm.models._registry import model_entrypoint

    grouped = defaultdict(list)
    for name in timm.list_models():
        grouped[model_entrypoint(name).__module__.removeprefix("timm.models.")].append(name)
    return dict(sorted(grouped.items()))


def profile(name: str) -> Profile | None:
    """`name` built on the meta device (no memory, no weights); None when it does not build there."""
    import timm

    try:
        with torch.device("meta"):
            model = timm.create_model(name, pretrained=False)
    except Exception:  # a model that computes values at construction; its family is tried by others
        return None
    head = UNIT_MODULES["head"]
    attention = sorted({type(m).__name__ for m in model.modules()
                        if head.search(type(m).__name__) and not type(m).__name__.endswith("Head")})
    return Profile(name, sum(p.numel() for p in model.parameters()), tuple(attention))


def smallest_build(name: str) -> Build:
    """The smallest settings at which `name` builds and runs on the CPU; raises the last error otherwise."""
    import timm

    error: Exception | None = None
    for side in (*SIZES, timm.models.get_pretrained_cfg(name).input_size[-1]):
        for depth in ({"depth": 2}, {}):
            for size in ({"img_size": side}, {}):
                kwargs = {**depth, **size}
                try:
                    torch.manual_seed(0)
                    model = timm_model(name, kwargs, depth=None).eval()
                    with torch.no_grad():
                        model(torch.randn(2, 3, side, side))
                    return Build(kwargs, side)
                except Exception as e:  # not these settings; try larger ones
                    error = e
    raise error


def representative(family: str, names: list[str]) -> dict | None:
    """The family's list entry, or None when none of its models holds attention."""
    profiles = sorted((p for p in map(profile, names) if p and p.attention), key=lambda p: (p.params, p.name))
    if not profiles:
        return None
    reasons = []
    for p in profiles[:CANDIDATES]:
        try:
            build = smallest_build(p.name)
        except Exception as e:  # the next candidate, or the family is skipped with this reason
            reasons.append(f"{p.name}: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}")
            continue
        return {"model": p.name, "family": family, "attention": list(p.attention), "kwargs": build.kwargs,
                "input": [3, build.side, build.side]}
    return {"model": profiles[0].name, "family": family, "attention": list(profiles[0].attention), "kwargs": {},
            "skip": "; ".join(reasons)}


def write_families(path: Path = FAMILIES) -> list[dict]:
    """Write the representatives of every family with attention to `path` and return them."""
    warnings.filterwarnings("ignore")
    entries = []
    for family, names in families().items():
        entry = representative(family, names)
        if entry:
            entries.append(entry)
            print(f"{family:<28} {entry['model']:<40} {entry.get('skip') or entry['kwargs']}", flush=True)
    path.write_text(json.dumps(entries, indent=1) + "\n")
    return entries
