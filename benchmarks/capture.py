"""Capture + analysis of Hugging Face's ViT-Base (the concrete-shape front end, torch.export) beside the
symbolic-trace analysis of timm's vit_base_patch16_224, measured in one run on this machine.

Both models are ViT-Base (12 blocks, 12 heads, width 768, 224x224, patch 16), random weights. Runs alternate
(timm, HF, timm, HF, ...) so a loaded machine slows both alike; the medians and their ratio are printed.
Target: HF / timm <= 2.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time

import timm
import torch

from fxsurgery import Surgeon


def _analysis_seconds(model: torch.nn.Module, x: torch.Tensor) -> tuple[float, int]:
    fresh = copy.deepcopy(model)
    start = time.perf_counter()
    surgeon = Surgeon(fresh, (x,))
    return time.perf_counter() - start, len(surgeon.groups)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    import transformers

    torch.manual_seed(0)
    timm_vit = timm.create_model("vit_base_patch16_224", pretrained=False).eval()
    hf_vit = transformers.ViTForImageClassification(transformers.ViTConfig()).eval()
    x = torch.randn(2, 3, 224, 224)
    times: dict[str, list[float]] = {"timm": [], "hf": []}
    groups = {}
    for _ in range(args.repeat):
        for name, model in (("timm", timm_vit), ("hf", hf_vit)):
            seconds, groups[name] = _analysis_seconds(model, x)
            times[name].append(seconds)
    timm_s, hf_s = statistics.median(times["timm"]), statistics.median(times["hf"])
    print(f"timm vit_base_patch16_224, symbolic trace + analysis: {timm_s:.2f} s ({groups['timm']} groups)")
    print(f"HF ViTForImageClassification (ViT-Base), capture + analysis: {hf_s:.2f} s ({groups['hf']} groups)")
    print(f"ratio HF / timm: {hf_s / timm_s:.2f} (target <= 2)")


if __name__ == "__main__":
    main()
