"""Step-time overhead of BARTER on CPU for a vit_tiny-sized model at density 0.5.

Prints the median step time of Static (the same initial widths), of BARTER while scores are collected (a step
of the window without a proposal: hooks on), of BARTER after the window (hooks off) against Static with the
same (moved) widths, and the wall time of one transfer. Targets: in-window <= 1.10x Static, after <= 1.02x
Static, one transfer <= one step.

    .venv/bin/python benchmarks/overhead.py [--steps 40] [--batch 32]
"""
from __future__ import annotations

import argparse
import statistics
import time

import timm
import torch

import barter


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    # vit_tiny widths (dim 192, 3 heads, MLP 768, depth 12) on 32-px images with 4-px patches: 65 tokens
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=10, img_size=32, patch_size=4)


def train_step(ctl, opt, x, y) -> None:
    torch.nn.functional.cross_entropy(ctl.model(x), y).backward()
    opt.step()
    if not ctl.auto:
        ctl.step()
    opt.zero_grad()


def timed_steps(ctl, opt, x, y, n: int) -> list[float]:
    """Wall time of n training steps (forward, backward, optimizer step, controller step)."""
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        train_step(ctl, opt, x, y)
        out.append(time.perf_counter() - t0)
    return out


def setup(method: str, total_steps: int, auto: bool = True):
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
    return barter.wrap(model, opt, total_steps=total_steps, density=0.5, method=method, auto=auto), opt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=32)
    args = ap.parse_args()
    x, y = torch.randn(args.batch, 3, 32, 32), torch.randint(0, 10, (args.batch,))

    static = setup("static", 100_000)
    # T large: the first proposal is thousands of steps away, so these are window steps with hooks on
    inside = setup("barter", 100_000)
    # T small: every proposal falls in the first few steps; time the transfers, then the steps after them
    after, opt = setup("barter", 20, auto=False)  # ctl.step by hand, to time it alone
    transfer_times = []
    for _ in range(max(max(v) for v in after.schedule.values())):
        torch.nn.functional.cross_entropy(after.model(x), y).backward()
        opt.step()
        opt.zero_grad()
        n = len(after.events)
        t0 = time.perf_counter()
        after.step()
        done = sum(e["skipped"] is None for e in after.events[n:])
        if done:
            transfer_times.append((time.perf_counter() - t0) / done)

    # Static with the after-window widths: its groups brought to the same counts (values do not matter)
    same = setup("static", 100_000)
    for g in same[0].surgeon.groups:
        target = after.surgeon.group(g.name).count
        while g.count < target:
            same[0].surgeon.clone(g, 0)
        while g.count > target:
            same[0].surgeon.remove(g, g.count - 1)

    # interleave the runs step by step so that drifting machine load hits them alike
    runs = {"static": static, "inside": inside, "after": (after, opt), "same": same}
    times: dict[str, list[float]] = {k: [] for k in runs}
    for i in range(5 + args.steps):
        for name, (ctl, o) in runs.items():
            t = timed_steps(ctl, o, x, y, 1)[0]
            if i >= 5:
                times[name].append(t)
    t_static, t_inside, t_after, t_same = (statistics.median(times[k]) for k in ("static", "inside", "after", "same"))
    t_transfer = statistics.median(transfer_times)

    print(f"model: vit_tiny widths, img 32, patch 4, batch {args.batch}, density 0.5, "
          f"{torch.get_num_threads()} threads, {args.steps} timed steps each, interleaved")
    print(f"static          median step {t_static * 1e3:8.2f} ms")
    print(f"barter window   median step {t_inside * 1e3:8.2f} ms  ({t_inside / t_static:.3f}x static, target <= 1.10)")
    print(f"static, widths after the window  {t_same * 1e3:8.2f} ms")
    print(f"barter after    median step {t_after * 1e3:8.2f} ms  ({t_after / t_same:.3f}x static with the same widths, "
          f"target <= 1.02; {t_after / t_static:.3f}x static at the initial widths)")
    print(f"one transfer    median      {t_transfer * 1e3:8.2f} ms  ({t_transfer / t_static:.3f}x a step, target <= 1; "
          f"{sum(e['skipped'] is None for e in after.events)} transfers)")


if __name__ == "__main__":
    main()
