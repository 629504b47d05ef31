"""Training-step time and peak memory of Dense, Static, BARTER and the baselines (RigL, SET, SNFS, SRigL, S²ViTE) on
CCT-7/3x1 and the paper's ViT.

For each model and density rho in {0.1, 0.3, 0.5, 0.7}, one run times the median training step (forward, loss,
backward, AdamW step, method step) of every configuration, interleaved step by step after warm-up so that
drifting machine load hits them alike. "barter" runs with a long horizon, so its activation x gradient score
taps are on (a step inside its transfer window); "barter-after" is built with a one-step horizon, so every
transfer runs after its first warm-up step and its taps are gone (a step after the window). Blocks of one
model have equal widths, so moving units leaves the FLOPs unchanged: barter-after and Static execute the same
FLOPs per step (the GFLOP column, counted by `barter.training.flops` on the last warm-up step, shows it). The
baselines' medians are ordinary steps (no mask update falls in the timed steps; one step in 100 is an update).
Their step times sit beside BARTER's as ratios to Dense ("x dense", and one line per model at density 0.5).

SRigL keeps a constant fan-in, so a layer can run condensed (`barter.baselines.condensed_linear`: each output
reads only its k inputs). One line per model and density times the forward of its largest sparse layer on
CONDENSED_ROWS input rows, condensed against the masked dense matmul that training runs, as a ratio.

Threads: on CPU, torch runs `--threads` threads (default 1: on a shared machine one thread per process keeps the
interleaved timings steady, as in the tests); the ratios are those of single-thread compute.

Peak memory (barter-after's includes its transfers): on CUDA, torch.cuda.max_memory_allocated during warm-up
and one step of the configuration alone, minus what was allocated before it was built (model, optimizer state,
masks, activations, workspace). On CPU, each configuration runs alone in a subprocess and the number is the
growth of the process's peak RSS (ru_maxrss) from just before the model is built to after warm-up and one step:
it includes allocator slack and is only comparable between rows of the same run.

Amortised cost of topology updates, per model and density, over a run of the presets' length (RUN_STEPS): for
BARTER, the seconds its controller spends in the steps that attempt transfers (proposals, surgery; synchronised on
CUDA), measured on barter-after, whose first step runs every proposal of the schedule (as many as a run of any
length has: their number depends on the unit budget, not on the horizon), divided by the run's steps and given as
a fraction of barter-after's median step. Static never changes its topology. For RigL, "rigl-update" is RigL with a
mask update at every step; the extra cost of an update step (its median minus RigL's ordinary median) times the
updates a run of that length has (every 100 steps before 75% of it), divided by the run's steps and as a fraction
of RigL's median step.

With `--compile`, Static, BARTER and barter-after are also trained through `barter.compiling.compile_model`
("+compile" rows; warm-up includes the first compile) and one line per model and density prints the compiled /
eager step-time ratios. `--amp bf16` runs every step under bf16 autocast.

    .venv/bin/python benchmarks/step_time.py [--quick] [--device cuda] [--amp bf16] [--compile] [--batch 128]
        [--steps 10] [--threads 1]
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import math
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager as ContextManager
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import barter
from barter.baselines import METHODS as BASELINES
from barter.baselines import SparseTraining, build_baseline, condensed_linear
from barter.compiling import compile_model
from barter.rebuild import timm_with_models
from barter.training.flops import StepFlops, run_step

timm = timm_with_models()

MODELS = {"CCT-7/3x1": "cct_7_3x1_32", "ViT (paper)": "vit_paper_p8_64"}
METHODS = ("dense", "static", "barter", "barter-after", *BASELINES)
UPDATE_EVERY_STEP = "rigl-update"  # RigL whose every step is a mask update, timing the update steps' extra cost
DENSITIES = (0.1, 0.3, 0.5, 0.7)
COMPILED = "+compile"  # suffix of a configuration trained through torch.compile (--compile)
COMPILED_METHODS = ("static", "barter", "barter-after")
AUTOCAST: Callable[[], ContextManager] = contextlib.nullcontext  # --amp bf16 sets torch.autocast
AMP = "fp32"
HORIZON = 1_000_000  # total steps given to every method: BARTER's taps stay on, no baseline's update is timed
AFTER_HORIZON = 1  # window [rnd(0.1 T), rnd(0.4 T)] = [0, 0]: every proposal runs right after step 1
# steps of the presets' runs: cct_cifar100 300 epochs of ceil(45,000 / 128), vit_tinyimagenet 100 of 3 x 100,000 // 128
RUN_STEPS = {"cct_7_3x1_32": 300 * 352, "vit_paper_p8_64": 100 * 2343}
CONDENSED_ROWS = 256  # input rows (tokens) of the condensed-layer timing
CONDENSED_REPEATS = 20


@dataclass
class TransferTime:
    """Seconds a controller spent in its steps that attempted transfers, and how many it attempted and executed."""

    seconds: float = 0.0
    attempted: int = 0
    executed: int = 0


def clock_transfers(ctl: barter.Controller, device: str) -> TransferTime:
    """Time `ctl.step` whenever it attempts transfers, until its last scheduled proposal (then the plain step)."""
    clock = TransferTime()
    last = max(max(steps, default=0) for steps in ctl.schedule.values())
    plain = ctl.step

    def timed_step() -> None:
        before = len(ctl.events)
        seconds = synchronised_seconds(plain, device)
        if len(ctl.events) > before:
            clock.seconds += seconds
            clock.attempted += len(ctl.events) - before
            clock.executed += sum(e["skipped"] is None for e in ctl.events[before:])
        if ctl.step_count >= last:
            del ctl.step  # the class's step again

    ctl.step = timed_step
    return clock


@dataclass
class Run:
    """One configuration ready to train: its model, optimizer and what follows `optimizer.step()`."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    after_step: Callable[[], None]
    controller: barter.Controller | None = None
    forward: torch.nn.Module | None = None  # the compiled model, for a "+compile" configuration
    sparse: SparseTraining | None = None  # the baseline's driver
    transfers: TransferTime | None = None  # barter-after's transfer time


def build(arch: str, method: str, density: float, device: str) -> Run:
    """A fresh `arch` trained by `method` at `density` (dense ignores it); BARTER's own hook follows the step. A
    method named "...+compile" trains through `barter.compiling.compile_model`."""
    if method.endswith(COMPILED):
        run = build(arch, method.removesuffix(COMPILED), density, device)
        run.forward = compile_model(run.model, run.controller)
        return run
    torch.manual_seed(0)
    model = timm.create_model(arch).to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.05)
    if method == UPDATE_EVERY_STEP:
        sp = build_baseline("rigl", model, opt, density=density, total_steps=HORIZON, update_interval=1)
        return Run(model, opt, sp.step, sparse=sp)
    if method in BASELINES:  # RigL's schedule is a preset run's, so that its updates can be counted
        total = RUN_STEPS[arch] if method == "rigl" else HORIZON
        sp = build_baseline(method, model, opt, density=density, total_steps=total)
        return Run(model, opt, sp.step, sparse=sp)
    if method == "dense":
        return Run(model, opt, lambda: None)
    horizon = AFTER_HORIZON if method == "barter-after" else HORIZON
    ctl = barter.wrap(model, opt, total_steps=horizon, density=density, method=method.removesuffix("-after"))
    transfers = clock_transfers(ctl, device) if method == "barter-after" else None
    return Run(model, opt, lambda: None, controller=ctl, transfers=transfers)


def batch(arch: str, size: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    c, h, w = timm.models.get_pretrained_cfg(arch).input_size
    classes = timm.models.get_pretrained_cfg(arch).num_classes
    g = torch.Generator().manual_seed(0)
    return (torch.randn(size, c, h, w, generator=g).to(device),
            torch.randint(0, classes, (size,), generator=g).to(device))


def train_step(run: Run, x: torch.Tensor, y: torch.Tensor, count: bool = False) -> StepFlops | None:
    """Forward, loss and backward as training runs them (`barter.training.flops.run_step`; FLOPs counted if `count`),
    then the optimizer and the method's step."""
    forward = run.model if run.forward is None else run.forward
    _, _, flops = run_step(forward, x, lambda out: torch.nn.functional.cross_entropy(out, y), count, autocast=AUTOCAST)
    run.optimizer.step()
    run.after_step()
    run.optimizer.zero_grad()
    return flops


def timed_step(run: Run, x: torch.Tensor, y: torch.Tensor) -> float:
    """Seconds of one training step: CUDA events on a GPU, wall time on CPU."""
    if x.is_cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        train_step(run, x, y)
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    train_step(run, x, y)
    return time.perf_counter() - t0


def peak_memory_cuda(arch: str, method: str, density: float, x: torch.Tensor, y: torch.Tensor, warmup: int) -> float:
    """MiB allocated at peak by this configuration alone (see the module docstring)."""
    gc.collect()  # earlier runs' model/optimizer/hook cycles
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    run = build(arch, method, density, "cuda")
    for _ in range(warmup + 1):
        train_step(run, x, y)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del run
    return peak / 2**20


def peak_rss_child(arch: str, method: str, density: float, batch_size: int, warmup: int) -> None:
    """Subprocess body: print the growth of peak RSS (MiB) over building and training this configuration."""
    x, y = batch(arch, batch_size, "cpu")
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    run = build(arch, method, density, "cpu")
    for _ in range(warmup + 1):
        train_step(run, x, y)
    print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024)  # ru_maxrss is in KiB on Linux


def peak_memory_cpu(arch: str, method: str, density: float, batch_size: int, warmup: int) -> float:
    out = subprocess.run([sys.executable, __file__, "--child", arch, method, str(density), "--batch",
                          str(batch_size), "--warmup", str(warmup), "--threads", str(torch.get_num_threads()),
                          "--amp", AMP],
                         check=True, capture_output=True, text=True)
    return float(out.stdout.strip().splitlines()[-1])


def median_seconds(fn: Callable[[], torch.Tensor], device: str, repeats: int) -> float:
    """Median wall time of `fn()` after one warm-up call (synchronised on CUDA)."""
    fn()
    return statistics.median(synchronised_seconds(fn, device) for _ in range(repeats))


def synchronised_seconds(fn: Callable[[], object], device: str) -> float:
    """Wall time of one call of `fn`, with the GPU's queued work finished before and after it."""
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


@torch.no_grad()
def condensed_layer(arch: str, density: float, device: str) -> tuple[str, str, float]:
    """(layer, "out x in, fan-in k", condensed / masked forward time) of SRigL's largest sparse layer."""
    torch.manual_seed(0)
    model = timm.create_model(arch).to(device)
    sp = build_baseline("srigl", model, torch.optim.AdamW(model.parameters()), density=density, total_steps=HORIZON)
    name = max(sp.weights, key=lambda n: sp.weights[n].numel())
    weight, mask = sp.weights[name], sp.masks[name]
    x = torch.randn(CONDENSED_ROWS, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(device)
    condensed = sp.condensed(name)
    masked = median_seconds(lambda: torch.nn.functional.linear(x, weight * mask), device, CONDENSED_REPEATS)
    packed = median_seconds(lambda: condensed_linear(x, condensed), device, CONDENSED_REPEATS)
    return name, f"{weight.shape[0]}x{weight.shape[1]}, fan-in {sp.fan_in()[name]}", packed / masked


def configs(densities: tuple[float, ...], compiled: bool = False) -> list[tuple[str, float]]:
    """(method, density) pairs; Dense once (its density is 1); with `compiled`, Static and BARTER (inside and
    after the window) also trained through torch.compile."""
    extra = [m + COMPILED for m in COMPILED_METHODS] if compiled else []
    return [("dense", 1.0)] + [(m, d) for d in densities for m in (*METHODS[1:], UPDATE_EVERY_STEP, *extra)]


def measure(arch: str, densities: tuple[float, ...], args: argparse.Namespace) -> dict[tuple[str, float], dict]:
    """{(method, density): {"time": median seconds, "mem": MiB or None, "flops": per step}} for one model, with
    barter-after's "transfers" (TransferTime) and RigL's "updates" in a preset run."""
    x, y = batch(arch, args.batch, args.device)
    results = {c: {"time": math.nan, "mem": None, "flops": math.nan} for c in configs(densities, args.compile)}
    if args.memory:
        for (method, d), r in results.items():
            r["mem"] = (
                peak_memory_cuda(arch, method, d, x, y, args.warmup) if args.device == "cuda"
                else peak_memory_cpu(arch, method, d, args.batch, args.warmup))
    runs = {c: build(arch, *c, args.device) for c in results}
    times: dict[tuple[str, float], list[float]] = {c: [] for c in runs}
    for i in range(args.warmup + args.steps):
        for c, run in runs.items():
            if i < args.warmup:
                counted = train_step(run, x, y, count=i == args.warmup - 1)
                if counted is not None:
                    results[c]["flops"] = counted.total
            else:
                times[c].append(timed_step(run, x, y))
    for c, run in runs.items():
        results[c]["time"] = statistics.median(times[c])
        if run.transfers is not None:
            results[c]["transfers"] = run.transfers
        if c[0] == "rigl":
            results[c]["updates"] = sum(map(run.sparse.is_update_step, range(1, RUN_STEPS[arch] + 1)))
    return results


def _mib(result: dict) -> str:
    return "-" if result["mem"] is None else f"{result['mem']:.1f}"


def report(name: str, results: dict[tuple[str, float], dict], densities: tuple[float, ...]
           ) -> dict[float, tuple[float, float]]:
    """Print one model's table and ratios; return {density: (BARTER/RigL, barter-after/Static) step time}."""
    dense = results["dense", 1.0]
    print(f"\n{name}")
    print(f"{'density':>7} {'method':>12} {'step ms':>9} {'x dense':>8} {'GFLOP':>8} {'peak MiB':>9}")
    rows = [(1.0, "dense")] + [(d, m) for d in densities for m in METHODS[1:]]
    for d, m in rows:
        r = results[m, d]
        print(f"{d:7.1f} {m:>12} {r['time'] * 1e3:9.1f} {r['time'] / dense['time']:8.3f} {r['flops'] / 1e9:8.2f} "
              f"{_mib(r):>9}")
    if 0.5 in densities:
        print("x dense at 0.5: " + ", ".join(f"{m} {results[m, 0.5]['time'] / dense['time']:.3f}"
                                             for m in ("barter", *BASELINES)))
    print(f"{'density':>7} {'BARTER/RigL time':>17} {'BARTER/Static time':>19} {'after/Static time':>18} "
          f"{'BARTER/RigL mem':>16} {'BARTER/Static mem':>18}")
    ratios = {}
    for d in densities:
        b, after, rigl, static = (results[m, d] for m in ("barter", "barter-after", "rigl", "static"))
        ratios[d] = (b["time"] / rigl["time"], after["time"] / static["time"])
        mems = ("-", "-") if b["mem"] is None else (f"{b['mem'] / rigl['mem']:.3f}", f"{b['mem'] / static['mem']:.3f}")
        print(f"{d:7.1f} {ratios[d][0]:17.3f} {b['time'] / static['time']:19.3f} {ratios[d][1]:18.3f} "
              f"{mems[0]:>16} {mems[1]:>18}")
    return ratios


def report_topology_cost(name: str, arch: str, results: dict[tuple[str, float], dict],
                         densities: tuple[float, ...]) -> None:
    """Print the amortised per-step cost of topology updates of BARTER, Static and RigL (module docstring)."""
    steps = RUN_STEPS[arch]
    for d in densities:
        after, rigl, update = (results[m, d] for m in ("barter-after", "rigl", UPDATE_EVERY_STEP))
        clock = after["transfers"]
        barter_cost = clock.seconds / steps
        extra = update["time"] - rigl["time"]
        rigl_cost = rigl["updates"] * extra / steps
        print(f"{name} topology updates at {d:g}, amortised over a {steps:,}-step run: "
              f"BARTER {clock.executed}/{clock.attempted} transfers executed, {clock.seconds * 1e3:.1f} ms in all, "
              f"{barter_cost * 1e3:.4f} ms/step ({100 * barter_cost / after['time']:.4f}% of its median step); "
              f"Static 0 ms/step (no updates); "
              f"RigL {rigl['updates']} updates x {extra * 1e3:.1f} ms extra, {rigl_cost * 1e3:.4f} ms/step "
              f"({100 * rigl_cost / rigl['time']:.4f}% of its median step)")


def report_compiled(name: str, results: dict[tuple[str, float], dict], densities: tuple[float, ...]) -> None:
    """Print the compiled / eager step-time ratios of Static and BARTER (inside and after the window)."""
    for d in densities:
        print(f"{name} compiled/eager step time at {d:g}: " + ", ".join(
            f"{m} {results[m + COMPILED, d]['time'] / results[m, d]['time']:.3f}" for m in COMPILED_METHODS))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="density 0.5 only, few steps, no CPU memory runs")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--batch", type=int, help="default 128 (the presets'); 32 with --quick on CPU")
    ap.add_argument("--steps", type=int, help="timed steps per configuration (default 10, --quick 3)")
    ap.add_argument("--warmup", type=int, default=2,
                    help="untimed steps first (>= 2: barter-after transfers after the first; FLOPs of the last)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1, see above)")
    ap.add_argument("--no-memory", dest="memory", action="store_false")
    ap.add_argument("--compile", action="store_true",
                    help="also time Static and BARTER trained through torch.compile; print compiled/eager ratios")
    ap.add_argument("--amp", default="fp32", choices=("fp32", "bf16"), help="bf16: steps under torch.autocast")
    ap.add_argument("--child", nargs=3, metavar=("ARCH", "METHOD", "DENSITY"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.warmup < 2:
        ap.error("--warmup must be >= 2")
    torch.set_num_threads(args.threads)
    global AUTOCAST, AMP
    AMP = args.amp
    if args.amp == "bf16":
        AUTOCAST = functools.partial(torch.autocast, args.device, dtype=torch.bfloat16)
    if args.child:
        arch, method, d = args.child
        return peak_rss_child(arch, method, float(d), args.batch, args.warmup)
    if args.device == "cuda":
        if not torch.cuda.is_available():
            sys.exit("--device cuda: no CUDA device available")
        torch.backends.cuda.matmul.allow_tf32 = False  # the paper trains in FP32 without TF32
        torch.backends.cudnn.allow_tf32 = False
    cpu_quick = args.quick and args.device == "cpu"
    args.batch = args.batch or (32 if cpu_quick else 128)
    args.steps = args.steps or (3 if args.quick else 10)
    args.memory = args.memory and not cpu_quick
    densities = (0.5,) if args.quick else DENSITIES
    print(f"device {args.device}, batch {args.batch}, {args.warmup} warm-up + {args.steps} timed steps, interleaved; "
          f"{torch.get_num_threads()} CPU threads; memory: "
          + ("off" if not args.memory else "CUDA max allocated" if args.device == "cuda" else "peak RSS growth"))
    ratios = {}
    for name, arch in MODELS.items():
        results = measure(arch, densities, args)
        ratios[name] = report(name, results, densities)
        report_topology_cost(name, arch, results, densities)
        if args.compile:
            report_compiled(name, results, densities)
    print()
    for name, arch in MODELS.items():
        for d in densities:
            layer, shape, ratio = condensed_layer(arch, d, args.device)
            print(f"SRigL condensed/masked forward, {name} {layer} ({shape}, {CONDENSED_ROWS} rows) at {d:g}: "
                  f"{ratio:.3f}")
    at_half = {label: [r[0.5][i] for r in ratios.values()] for i, label in enumerate(("BARTER/RigL", "after/Static"))}
    print()
    for label, values in at_half.items():
        print(f"{label} step time at 0.5: " + ", ".join(f"{name}: {v:.3f}" for name, v in zip(ratios, values))
              + f" (geometric mean {statistics.geometric_mean(values):.3f})")
    print(f"BARTER/RigL step-time ratio at density 0.5: {statistics.geometric_mean(at_half['BARTER/RigL']):.3f}")


if __name__ == "__main__":
    main()
