"""The analysis of models larger than one host, built on the meta device (no memory for their weights): wall time
and peak RSS of `fxsurgery.analyse` for timm vit_base, vit_large and vit_giant and, where transformers is installed,
Llamas of the 8B shape (hidden 4096, 32 heads, 8 KV heads, intermediate 14336, vocabulary 128256) and the 70B shape
(hidden 8192, 64 heads, 8 KV heads, intermediate 28672, 80 layers), each as a ratio to its parameter count; the
time per block of the 8B shape at 8, 16 and 32 layers (the analysis should cost linearly in depth); and the memory a
transfer gathers under FSDP2, as a fraction of one rank's shard at 8 ranks.

    python benchmarks/scale.py [--rows vit_base,vit_large,vit_giant,llama_8b,llama_70b] [--depths 8,16,32]
                               [--layers-70b 8,16]

Each row runs in a fresh interpreter, so its peak RSS is its own (`resource.getrusage`, ru_maxrss). The 70B shape is
analysed at the ``--layers-70b`` depths only, and its 80 layers extrapolated from them by the per-block cost (said
so in its row). A transfer under FSDP2 (`barter.fsdp`) gathers the tensors of the two groups it edits (the donor's
and the receiver's, each whole) and their two Adam moments; one rank holds an eighth of every parameter and its two
moments: the fraction is their ratio, read from the analysed groups' tensors and the full-depth model's size.
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parents[1]
LLAMAS = {  # hidden, intermediate, heads, KV heads, layers, vocabulary
    "llama_8b": (4096, 14336, 32, 8, 32, 128256),
    "llama_70b": (8192, 28672, 64, 8, 80, 128256),
}
VITS = {"vit_base": "vit_base_patch16_224", "vit_large": "vit_large_patch16_224", "vit_giant": "vit_giant_patch14_224"}
ADAM_MOMENTS = 2  # exp_avg and exp_avg_sq, each the size of its parameter


def build(name: str, depth: int | None) -> tuple:
    """The model ``name`` built on the meta device (at ``depth`` blocks, if given) and its example call."""
    import torch
    with torch.device("meta"):
        if name in VITS:
            import timm
            model = timm.create_model(VITS[name], **({} if depth is None else {"depth": depth}))
            return model, (torch.zeros(2, 3, *model.default_cfg["input_size"][1:]),), {}
        from transformers import LlamaConfig, LlamaForCausalLM
        hidden, intermediate, heads, kv_heads, layers, vocab = LLAMAS[name]
        config = LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_attention_heads=heads,
                             num_key_value_heads=kv_heads, num_hidden_layers=depth or layers, vocab_size=vocab)
        model = LlamaForCausalLM(config)
        return model, (), {"input_ids": torch.zeros(2, 16, dtype=torch.long)}


class TransferMemory(NamedTuple):
    """What a transfer gathers under FSDP2 against what one rank holds, in bytes."""

    gathered: int  # the donor's and the receiver's group tensors, whole, and their Adam moments
    shard: int  # one rank's share of every parameter and its Adam moments
    ranks: int

    @property
    def fraction(self) -> float:
        return self.gathered / self.shard


def group_bytes(model: Any, analysis: Any) -> list[int]:
    """Bytes of each group's tensors (those its slices cut, each once): what an edit of the group gathers whole."""
    sizes = []
    for g in analysis.groups:
        tensors = {sl.name: model.get_parameter(sl.name) for sl in g.slices}
        sizes.append(sum(t.numel() * t.element_size() for t in tensors.values()))
    return sizes


def transfer_memory(groups: list[int], model_bytes: int, ranks: int = 8) -> TransferMemory:
    """The largest transfer's gathered bytes (the two largest groups: a donor and a receiver in two layers, each
    with its Adam moments) against one rank's shard of the model's ``model_bytes`` of parameters with theirs."""
    two = sorted(groups)[-2:]
    return TransferMemory(sum(two) * (1 + ADAM_MOMENTS), model_bytes * (1 + ADAM_MOMENTS) // ranks, ranks)


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
    full = model if depth is None else build(name, None)[0]  # the full depth, on meta: its size only
    model_bytes = sum(p.numel() * p.element_size() for p in full.parameters())
    memory = transfer_memory(group_bytes(model, analysis), model_bytes)
    return {"model": name, "depth": depth, "blocks": _blocks(model), "params": params, "groups": len(analysis.groups),
            "seconds": seconds, "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "full_params": sum(p.numel() for p in full.parameters()), "gathered": memory.gathered,
            "shard": memory.shard}


def _blocks(model: Any) -> int:
    """The model's number of blocks (its longest ModuleList or Sequential)."""
    import torch.nn as nn
    return max((len(m) for m in model.modules() if isinstance(m, (nn.ModuleList, nn.Sequential))),
               default=0)


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
    return (f"{r['model']:10s} {r['blocks']:3d} blocks  {r['params'] / 1e6:9.1f} M params  {r['groups']:4d} groups"
            f"  {r['seconds']:7.2f} s ({r['seconds'] / per_b:8.2f} s/B params)  peak RSS {r['peak_rss_gib']:5.2f} GiB"
            f" ({r['peak_rss_gib'] / per_b:6.2f} GiB/B params)  transfer gathers {r['gathered'] / 2**20:7.1f} MiB ="
            f" {r['gathered'] / r['shard']:6.2%} of a rank's shard at 8 ranks"
            f" ({r['full_params'] / 1e9:.1f} B params)")


def per_block(rows: list[dict]) -> list[str]:
    """Seconds per block at each depth, and the cost of each block added since the shallower row."""
    lines, before = [], None
    for r in rows:
        if "error" in r:
            continue
        added = "" if before is None else \
            f"  {(r['seconds'] - before['seconds']) / (r['blocks'] - before['blocks']):.3f} s per added block"
        lines.append(f"{r['model']:10s} {r['blocks']:3d} blocks  {r['seconds'] / r['blocks']:.3f} s per block{added}")
        before = r
    return lines


def extrapolated(rows: list[dict], blocks: int) -> str:
    """The time at ``blocks`` blocks from two shallower rows, by their per-block cost (peak RSS: the deeper row's,
    which the depth leaves alike where the analysis is linear)."""
    a, b = [r for r in rows if "error" not in r][-2:]
    slope = (b["seconds"] - a["seconds"]) / (b["blocks"] - a["blocks"])
    if slope <= 0:  # the fixed cost hides the blocks' at depths this shallow: no time to extrapolate from
        return (f"{b['model']:10s} {blocks:3d} blocks  NOT EXTRAPOLATED: {a['seconds']:.1f} s at {a['blocks']} blocks, "
                f"{b['seconds']:.1f} s at {b['blocks']}, no per-block cost to scale (give deeper --layers-70b)")
    seconds = b["seconds"] + slope * (blocks - b["blocks"])
    return (f"{b['model']:10s} {blocks:3d} blocks  EXTRAPOLATED from {a['blocks']} and {b['blocks']} blocks: "
            f"{seconds:7.1f} s ({slope:.2f} s per block; {seconds / (b['full_params'] / 1e9):.2f} s/B params), "
            f"peak RSS as at {b['blocks']} blocks, {b['peak_rss_gib']:.2f} GiB")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="vit_base,vit_large,vit_giant,llama_8b,llama_70b")
    parser.add_argument("--depths", default="8,16,32", help="depths of the 8B shape for the per-block time")
    parser.add_argument("--layers-70b", default="8,16", help="depths the 70B shape is analysed at, then extrapolated")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--depth", type=int, default=0, help=argparse.SUPPRESS)
    a = parser.parse_args(argv)
    if a.one:
        print(json.dumps(measure(a.one, a.depth or None)))
        return
    names = a.rows.split(",")
    for name in names:
        if name in VITS or (name == "llama_8b" and not a.depths):
            print(show(row(name, None)), flush=True)
        elif name in LLAMAS:  # the 8B shape at each depth for its per-block time; the 70B shape, then extrapolated
            rows = []
            for depth in (int(d) for d in (a.depths if name == "llama_8b" else a.layers_70b).split(",")):
                rows.append(row(name, depth))
                print(show(rows[-1]), flush=True)
            print("\n".join(per_block(rows)), flush=True)
            if name == "llama_70b" and sum("error" not in r for r in rows) >= 2:
                print(extrapolated(rows, LLAMAS[name][4]), flush=True)


if __name__ == "__main__":
    main()
