"""What serving every call costs on Hugging Face's ViT-Base (random weights), measured in one run:

1. the first call of a signature the hosts were not analysed on (a batch of one: a capture specialises sizes 0
   and 1), which captures a graph for each kind of host, against the same call once they hold it;
2. a training step (keyword call with labels, backward, AdamW) of the model wrapped by `barter.wrap` after its
   window (density 1, so the widths equal the unwrapped model's and only the installed graphs differ) against
   the same model unwrapped. Runs alternate so a loaded machine slows both alike; medians and the ratio are
   printed. Target: wrapped / unwrapped <= 1.02.
"""
from __future__ import annotations

import argparse
import copy
import functools
import statistics
import time

import torch
import transformers

import barter


def _synchronise(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device) -> float:
    _synchronise(device)
    start = time.perf_counter()
    fn()
    _synchronise(device)
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    plain = transformers.ViTForImageClassification(transformers.ViTConfig(num_labels=10)).to(device).train()
    wrapped = copy.deepcopy(plain)
    x = torch.randn(args.batch, 3, 224, 224, device=device)
    y = torch.randint(0, 10, (args.batch,), device=device)
    optimizers = {"plain": torch.optim.AdamW(plain.parameters(), lr=1e-4),
                  "wrapped": torch.optim.AdamW(wrapped.parameters(), lr=1e-4)}
    start = time.perf_counter()
    ctl = barter.wrap(wrapped, optimizers["wrapped"], total_steps=1, density=1.0, example_inputs=(x[:2],))
    print(f"barter.wrap (analysis of the example call): {time.perf_counter() - start:.2f} s, "
          f"{len(ctl.surgeon.groups)} groups")

    with torch.no_grad():
        wrapped.eval()
        one = x[:1]
        new = _timed(lambda: wrapped(pixel_values=one), device)
        known = statistics.median(_timed(lambda: wrapped(pixel_values=one), device) for _ in range(args.repeat))
    print(f"a call of a new signature (a batch of one): {new:.2f} s; once its graphs are held: {known:.3f} s; "
          f"capture cost: {new - known:.2f} s for the {len(ctl.surgeon.groups)} groups' hosts (built alike: one "
          "capture per kind of host)")

    def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        model.train()
        optimizer.zero_grad()
        model(pixel_values=x, labels=y).loss.backward()
        optimizer.step()

    models = {"plain": plain, "wrapped": wrapped}
    for name, model in models.items():  # warm-up: the training signature's graphs, allocator, kernels
        step(model, optimizers[name])
    times: dict[str, list[float]] = {"plain": [], "wrapped": []}
    for _ in range(args.repeat):
        for name, model in models.items():
            times[name].append(_timed(functools.partial(step, model, optimizers[name]), device))
    plain_s, wrapped_s = statistics.median(times["plain"]), statistics.median(times["wrapped"])
    print(f"training step (batch {args.batch}, {device.type}): unwrapped {plain_s:.3f} s, wrapped after the window "
          f"{wrapped_s:.3f} s")
    print(f"ratio wrapped / unwrapped: {wrapped_s / plain_s:.3f} (target <= 1.02)")


if __name__ == "__main__":
    main()
