"""Builds on the meta device replayed (`barter.meta_build`) against the same builds on the CPU, over the timm
conformance list: one row per model, ending `meta build: <equal>/<total> bit-equal, <refused> refused`.

A row builds the model on the CPU from seed 0, then on meta from seed 0 (recorded), materialises it, and compares
every parameter and buffer bit for bit, and the generator's state after (the replay draws what the build drew). A build
that cannot run on meta is refused with its reason (it reads a value it drew); a replay that differs is a failure.

    python benchmarks/meta_build.py [--models vit_tiny_patch16_224,hiera_tiny_224] [--llama-8b-layers 2]

`--llama-8b-layers N` also replays a Llama of the 8B shape (hidden 4096, 32 heads, 8 KV heads, intermediate
14336, vocabulary 128256) at N layers, as one process of a sharded run does, writing nothing: every process replays
every draw of the build, so the time is per process; the bytes held at once are its largest tensor's.
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


def llama_replay(layers: int) -> str:
    """The replay of an 8B-shape Llama's build at `layers` layers: its time per billion parameters and the most
    bytes it held at once."""
    import transformers

    from barter.meta_build import record_build, replay

    config = transformers.LlamaConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                                      num_key_value_heads=8, num_hidden_layers=layers, vocab_size=128256)
    model, record = record_build(lambda: transformers.LlamaForCausalLM(config))
    start = time.perf_counter()
    replayed = replay(record, lambda name, values: None)
    seconds = time.perf_counter() - start
    params = sum(p.numel() for p in model.parameters()) / 1e9
    return (f"llama 8B shape at {layers} layers ({params:.2f} B params): replayed in {seconds:.1f} s "
            f"({seconds / params:.1f} s per B params), at most {replayed.peak_bytes / 2 ** 30:.2f} GiB held of "
            f"{replayed.model_bytes / 2 ** 30:.2f} GiB")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=None, help="comma-separated models of the list (default: all)")
    parser.add_argument("--llama-8b-layers", type=int, default=0, help="also replay an 8B-shape Llama at N layers")
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
    if args.llama_8b_layers:
        print(llama_replay(args.llama_8b_layers))
    print(f"meta build: {equal}/{len(rows)} bit-equal, {refused} refused")
    return 0 if equal + refused == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
