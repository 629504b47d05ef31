"""The analysis of models larger than one host, built on the meta device (no memory for their weights): wall time
and peak RSS of `fxsurgery.analyse` for timm vit_base and vit_large and, where transformers is installed, a Llama
of the 8B shape (hidden 4096, 32 heads, 8 KV heads), each as a ratio to its parameter count; and the time per
block at 8, 16 and 32 blocks of vit_base's width (the analysis should cost linearly in depth).

    python benchmarks/scale.py [--rows vit_base,vit_large,llama_8b] [--depths 8,16,32]

Each row runs in a fresh interpreter, so its peak RSS is its own (`resource.getrusage`, ru_maxrss).
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def build(name: str, depth: int | None) -> tuple:
    """The model ``name`` built on the meta device (at ``depth`` blocks, if given) and its example call."""
    import torch
    with torch.device("meta"):
        if name.startswith("vit_"):
            import timm
            model = timm.create_model(f"{name}_patch16_224", **({} if depth is None else {"depth": depth}))
            return model, (torch.zeros(2, 3, 224, 224),), {}
        from transformers import LlamaConfig, LlamaForCausalLM
        config = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                             num_key_value_heads=8, num_hidden_layers=depth or 32, vocab_size=128256)
        model = LlamaForCausalLM(config)
        return model, (), {"input_ids": torch.zeros(2, 16, dtype=torch.long)}


def measure(name: str, depth: int | None) -> dict:
    """One row, in this interpreter: analyse the meta-built model once."""
    sys.path.insert(0, str(ROOT))
    import torch

    import fxsurgery
    model, args, kwargs = build(name, depth)
    args = tuple(a.to("meta") for a in args)
    kwargs = {k: v.to("meta") for k, v in kwargs.items()}
    start = time.perf_counter()
    analysis = fxsurgery.analyse(model, args, kwargs)
    seconds = time.perf_counter() - start
    params = sum(p.numel() for p in model.parameters())
    assert all(t.is_meta for t in model.parameters()) and torch.is_grad_enabled()
    return {"model": name, "depth": depth, "params": params, "groups": len(analysis.groups), "seconds": seconds,
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def row(name: str, depth: int | None) -> dict:
    """One row, measured in a fresh interpreter."""
    out = subprocess.run([sys.executable, __file__, "--one", name, "--depth", str(depth or 0)], capture_output=True,
                         text=True, cwd=ROOT)
    if out.returncode:
        return {"model": name, "depth": depth, "error": (out.stderr.strip().splitlines() or ["?"])[-1][:160]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def show(r: dict) -> str:
    if "error" in r:
        return f"{r['model']:10s} depth {r['depth'] or '-':>3}  failed: {r['error']}"
    per_b = r["params"] / 1e9
    return (f"{r['model']:10s} depth {r['depth'] or '-':>3}  {r['params'] / 1e6:9.1f} M params  {r['groups']:4d} groups"
            f"  {r['seconds']:7.2f} s ({r['seconds'] / per_b:8.2f} s/B params)  peak RSS {r['peak_rss_gib']:5.2f} GiB"
            f" ({r['peak_rss_gib'] / per_b:6.2f} GiB/B params)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="vit_base,vit_large,llama_8b")
    parser.add_argument("--depths", default="8,16,32")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--depth", type=int, default=0, help=argparse.SUPPRESS)
    a = parser.parse_args()
    if a.one:
        print(json.dumps(measure(a.one, a.depth or None)))
        return
    for name in a.rows.split(","):
        print(show(row(name, None)), flush=True)
    for depth in (int(d) for d in a.depths.split(",") if d):
        r = row("vit_base", depth)
        print(show(r) + ("" if "error" in r else f"  {r['seconds'] / depth:.3f} s per block"), flush=True)


if __name__ == "__main__":
    main()
