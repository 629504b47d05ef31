"""Analysis, surgery and forward cost of fxsurgery on timm's vit_base_patch16_224 (CPU, one run).

Prints, measured here and now:
  * analysis time of ``Surgeon`` beside torch-pruning's ``DependencyGraph().build_dependency``;
  * one head remove + clone with Adam state attached, beside one training step at batch 32;
  * forward time of the operated model (a head removed and a clone added: same shapes as the
    original) against the untouched model.
Targets: analysis <= 2 s and faster than torch-pruning; remove + clone <= one step; forward ratio <= 1.02.
"""
from __future__ import annotations

import argparse
import copy
import functools
import gc
import statistics
import time
import warnings

import timm
import torch
import torch_pruning as tp

from fxsurgery import Surgeon


def timed(fn, repeat: int = 1) -> float:
    """Median wall time of ``fn`` over ``repeat`` calls."""
    out = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="vit_base_patch16_224")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--forward-batch", type=int, default=8)
    p.add_argument("--forward-repeat", type=int, default=9)
    args = p.parse_args()
    torch.manual_seed(0)
    base = timm.create_model(args.model, pretrained=False)
    x1 = torch.randn(1, *base.pretrained_cfg["input_size"])
    xb = torch.randn(args.batch, *base.pretrained_cfg["input_size"])

    # analysis: each on a fresh copy made beforehand (neither times a copy), after one untimed run each (warm
    # caches), in alternating rounds so that a change in the machine's load reaches both alike, each after a full
    # garbage collection (neither pays for collecting what the other left)
    def build_dependency(model: torch.nn.Module) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tp.DependencyGraph().build_dependency(model, example_inputs=x1)

    def analyse(model: torch.nn.Module) -> None:
        Surgeon(model, (x1,))

    rounds = {build_dependency: [], analyse: []}
    for k in range(args.repeat + 1):
        for fn, times in rounds.items():
            model = copy.deepcopy(base)
            gc.collect()
            t = time.perf_counter()
            fn(model)
            if k:
                times.append(time.perf_counter() - t)
    t_tp, t_fx = (statistics.median(times) for times in rounds.values())
    print(f"analysis: fxsurgery {t_fx:.3f} s, torch-pruning build_dependency {t_tp:.3f} s (medians of {args.repeat} "
          f"alternating rounds); ratio {t_fx / t_tp:.2f}")

    # surgery vs one training step
    model = copy.deepcopy(base)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    s = Surgeon(model, (x1,))
    s.attach_optimizer(opt)
    y = torch.randint(0, 1000, (args.batch,))

    def step() -> None:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(xb), y).backward()
        opt.step()

    step()
    t_step = timed(step, args.repeat)
    head = s.group("blocks.5.attn:head")

    def remove_and_clone() -> None:
        s.remove(head, 3)
        s.clone(head, 0, noise_std=0.01, relative=True)

    t_op = timed(remove_and_clone, args.repeat)
    print(f"surgery: one head remove + clone with Adam state {t_op * 1e3:.1f} ms; "
          f"one training step at batch {args.batch} {t_step * 1e3:.0f} ms; ratio {t_op / t_step:.4f}")

    # forward of the operated model (same shapes as the original) vs the untouched one
    model.eval()
    opt.zero_grad()
    plain = copy.deepcopy(base).eval()
    xf = xb[: args.forward_batch]
    with torch.no_grad():
        model(xf), plain(xf)
        times = {"operated": [], "untouched": []}
        for r in range(args.forward_repeat):  # interleaved, order alternating, so drift hits both alike
            pair = [("operated", model), ("untouched", plain)]
            for key, m in pair if r % 2 == 0 else pair[::-1]:
                times[key].append(timed(functools.partial(m, xf)))
    fa, fb = statistics.median(times["operated"]), statistics.median(times["untouched"])
    print(f"forward at batch {args.forward_batch}: operated {fa * 1e3:.0f} ms, untouched {fb * 1e3:.0f} ms "
          f"(medians of {args.forward_repeat}); ratio {fa / fb:.3f}")


if __name__ == "__main__":
    main()
