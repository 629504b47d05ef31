"""BARTER under FSDP2 against DDP on two CPU processes (gloo, forked): step time, the time a transfer adds to its
step, per rank the parameter + optimizer memory, and the most memory a transfer allocates at once.

    python benchmarks/fsdp.py [--model vit_small_patch16_224] [--img-size 64] [--batch 16] [--steps 12]

Prints the ratios measured in this one run (FSDP2 / DDP step time, transfer / step time, memory shares). The
transfer's peak counts every tensor the transfer's ATen ops return afresh (gathered tensors, edited whole ones,
new shards, temporaries) that is alive at once, by storage.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
import weakref
from datetime import timedelta

import timm
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor

import barter
import barter.controller
from barter import fsdp as barter_fsdp
from barter.ddp import DistributedModel
from fxsurgery.compat import DispatchMode, returns_new_tensors, tree_leaves

WORLD = 2


class LiveBytes(DispatchMode):
    """While active: the bytes of the storages ATen ops return afresh that are still alive, and their peak, counted
    afresh from each `restart` (a transfer's own allocations: the new shards it leaves replace the old ones)."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: dict[int, int] = {}  # storage address -> bytes, while the storage lives
        self.live = self.peak = 0
        self.peaks: list[int] = []  # the peak of each count before the last restart

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if returns_new_tensors(func):
            for t in tree_leaves(out):
                local = t.to_local() if isinstance(t, DTensor) else t
                # a wrapper subclass (a collective's pending result) has no storage of its own; meta, shapes only
                if type(local) is torch.Tensor and not local.is_meta:
                    self.track(local.untyped_storage())
        return out

    def track(self, storage: torch.UntypedStorage) -> None:
        address = storage.data_ptr()
        if storage.nbytes() == 0 or address in self.sizes:
            return
        self.sizes[address] = storage.nbytes()
        self.live += storage.nbytes()
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self.release, address, self.sizes)

    def release(self, address: int, sizes: dict[int, int]) -> None:
        if sizes is self.sizes:
            self.live -= sizes.pop(address)

    def restart(self) -> None:
        """Count from zero: what is alive now is no longer counted."""
        self.peaks.append(self.peak)
        self.sizes, self.live, self.peak = {}, 0, 0


def held_bytes(tensors) -> int:
    """Bytes of the storages this rank holds for `tensors` (a DTensor's own shard), each storage once."""
    storages = {}
    for t in tensors:
        storage = (t.to_local() if isinstance(t, DTensor) else t).untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def whole_bytes(tensors) -> int:
    """Bytes of `tensors` whole (a DTensor's global shape)."""
    return sum(t.numel() * t.element_size() for t in tensors)


def state_of(optimizer, params) -> list[torch.Tensor]:
    """The per-element optimizer state tensors of `params`."""
    return [v for p in params for v in optimizer.state.get(p, {}).values() if torch.is_tensor(v) and v.dim()]


def touched_bytes(ctl, model, optimizer, event) -> int:
    """The bytes a transfer touches: its donor's and receiver's parameters and optimizer state, whole (at their
    widths after the step)."""
    names = {sl.name for layer in ("donor_group", "receiver_group") for sl in ctl.surgeon.group(event[layer]).slices}
    mine = [p for name, p in model.named_parameters() if name in names]
    return whole_bytes(mine) + whole_bytes(state_of(optimizer, mine))


def run(rank: int, args: argparse.Namespace, *, sharded: bool, measure: bool = False) -> dict:
    """`args.steps` steps of the wrapped model, DDP or FSDP2; with `measure`, each transfer runs under `LiveBytes`
    (which slows it: its times are not the benchmark's)."""
    torch.manual_seed(0)
    model = timm.create_model(args.model, img_size=args.img_size, num_classes=10)
    ctl = barter.wrap(model, total_steps=args.steps, density=0.5, window=(0.3, 0.9), auto=False)
    if sharded:
        barter_fsdp.shard(model)
        net = model
    else:
        net = DistributedModel(model, ctl)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ctl.attach_optimizer(optimizer)
    steps, transfers, peaks, held = [], [], [], []
    for step in range(args.steps):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(args.batch, 3, args.img_size, args.img_size, generator=g)
        y = torch.randint(0, 10, (args.batch,), generator=g)
        mine = slice(rank * args.batch // WORLD, (rank + 1) * args.batch // WORLD)
        dist.barrier()
        start = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(net(x[mine]), y[mine])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        stepped = time.perf_counter()
        edits, events = ctl.edits, len(ctl.events)
        with LiveBytes() if measure else contextlib.nullcontext() as live:
            if measure:  # each executed transfer makes its access to the sharded tensors first
                barter.controller.sharded_access = lambda model: live.restart() or barter_fsdp.sharded_access(model)
            ctl.step()
            if measure:
                live.restart()
        done = time.perf_counter()
        params = list(model.parameters())
        held.append(held_bytes(params) + held_bytes(state_of(optimizer, params)))
        if ctl.edits != edits:
            executed = [e for e in ctl.events[events:] if e["skipped"] is None]
            transfers.append((done - stepped) / (ctl.edits - edits))
            if measure:  # the first count ran before the first transfer
                peaks += [(peak, touched_bytes(ctl, model, optimizer, e)) for peak, e in zip(live.peaks[1:], executed)]
        elif step >= 2:
            steps.append(done - start)
    params = list(model.parameters())
    peak, touched = max(peaks, key=lambda pair: pair[0] / pair[1], default=(0, 1))  # the largest share
    return {"step_s": statistics.median(steps), "transfer_s": statistics.median(transfers) if transfers else None,
            "memory": max(held), "transfer_peak": peak, "touched": touched, "transfers": len(transfers),
            "edits": ctl.edits, "most": max((pair[0] for pair in peaks), default=0),
            "whole": whole_bytes(params) + whole_bytes(state_of(optimizer, params))}


def worker(rank: int, init_file: str, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=timedelta(minutes=5))
    try:
        results = {"ddp": run(rank, args, sharded=False), "fsdp": run(rank, args, sharded=True),
                   "measured": run(rank, args, sharded=True, measure=True)}
        torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="vit_small_patch16_224")
    parser.add_argument("--img-size", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(worker, args=(os.path.join(out, "init"), args, out), nprocs=WORLD, start_method="fork")
        ranks = [torch.load(os.path.join(out, f"rank{r}.pt")) for r in range(WORLD)]
    ddp, fsdp = ranks[0]["ddp"], ranks[0]["fsdp"]
    print(f"{args.model} at {args.img_size}px, global batch {args.batch}, {WORLD} CPU processes (gloo)")
    print(f"step time: DDP {ddp['step_s'] * 1e3:.1f} ms, FSDP2 {fsdp['step_s'] * 1e3:.1f} ms "
          f"(FSDP2 / DDP {fsdp['step_s'] / ddp['step_s']:.2f})")
    for name, result in (("DDP", ddp), ("FSDP2", fsdp)):
        if result["transfer_s"] is not None:
            print(f"{name} transfer: {result['transfer_s'] * 1e3:.1f} ms = "
                  f"{result['transfer_s'] / result['step_s']:.2f} of a step")
    print(f"whole model: parameters + optimizer state {fsdp['whole'] / 2**20:.2f} MiB; {fsdp['edits']} transfers in "
          f"{fsdp['transfers']} steps")
    for r, rank in enumerate(ranks):
        ddp_memory, fsdp_memory = rank["ddp"]["memory"], rank["fsdp"]["memory"]
        print(f"rank {r} peak parameters + optimizer state held: DDP {ddp_memory / 2**20:.2f} MiB, FSDP2 "
              f"{fsdp_memory / 2**20:.2f} MiB (FSDP2 / DDP {fsdp_memory / ddp_memory:.2f})")
        peak, touched, whole = (rank["measured"][key] for key in ("transfer_peak", "touched", "whole"))
        print(f"rank {r} FSDP2 transfer, the most one allocates at once against what it touches (its donor's and "
              f"receiver's parameters + optimizer state, whole): {peak / 2**20:.2f} MiB = {peak / touched:.2f} of "
              f"{touched / 2**20:.2f} MiB; {rank['measured']['most'] / whole:.3f} of the whole model's at most")
    return 0


if __name__ == "__main__":
    sys.exit(main())
