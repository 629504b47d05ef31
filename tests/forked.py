"""Multi-process tests on CPU: WORLD gloo processes, forked (no re-import of torch and timm)."""
import faulthandler
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

if "fork" not in mp.get_all_start_methods():
    pytest.skip("the processes are forked (no re-import of torch and timm)", allow_module_level=True)

WORLD = 2


def fork_processes(fn, *args, processes=WORLD):
    """Runs ``fn(rank, *args)`` in ``processes`` forked processes. A test runs its backward passes there, never in
    pytest's process: after a ``torch.export`` in a process, its next backward starts autograd's device threads, and
    a process forked from it then refuses to run a backward (so one test's work would fail the tests after it)."""
    mp.start_processes(_with_fault_stacks, args=(fn, *args), nprocs=processes, start_method="fork")


def _with_fault_stacks(rank, fn, *args):
    """Runs ``fn(rank, *args)`` in a forked process that prints every thread's stack to its stderr (which the test's
    failure shows) if a signal such as SIGSEGV kills it, so a crash inside torch's C++ names the call that made it."""
    faulthandler.enable(file=os.fdopen(os.dup(2), "w"), all_threads=True)
    fn(rank, *args)


def free_ports(n):
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def save_rank(out_dir, rank, controller, model, steps):
    """What a rank of a framework's DDP run ends with: events, weights, layer counts, budgets, steps."""
    counts = {kind: [g.count for g in controller.layers[kind]] for kind in controller.layers}
    torch.save({"events": controller.events, "params": model.state_dict(), "counts": counts,
                "initial": controller.initial, "steps": steps}, os.path.join(out_dir, f"rank{rank}.pt"))


def load_ranks(out_dir):
    """What each rank saved as ``rank<r>.pt`` in ``out_dir``."""
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(WORLD)]


def assert_ranks_agree(out_dir, steps):
    """Every rank made the same executed transfers, conserved the budgets, and ends with identical weights."""
    ranks = load_ranks(out_dir)
    executed = [e for e in ranks[0]["events"] if e["skipped"] is None]
    assert executed and ranks[0]["steps"] == steps
    assert ranks[0]["events"] == ranks[1]["events"] and ranks[0]["counts"] == ranks[1]["counts"]
    for kind, counts in ranks[0]["counts"].items():
        assert sum(counts) == sum(ranks[0]["initial"][kind])  # budgets conserved
    assert ranks[0]["params"].keys() == ranks[1]["params"].keys()
    for name, p in ranks[0]["params"].items():  # the gradients were all-reduced through every rebuild
        torch.testing.assert_close(ranks[1]["params"][name], p, rtol=0, atol=0, msg=name)


def assert_sharded_ranks_agree(ranks):
    """Transfers of both kinds ran, each chosen on non-zero scores (``scores``: per step, each kind's score mass
    before its transfers), and every rank logged the same events and ends with identical gathered parameters."""
    first = ranks[0]
    executed = [e for e in first["events"] if e["skipped"] is None]
    assert {e["kind"] for e in executed} == {"head", "channel"}
    for e in executed:
        assert first["scores"][e["step"] - 1][e["kind"]] > 0, e
    for other in ranks[1:]:
        assert other["events"] == first["events"]
        assert other["params"].keys() == first["params"].keys()
        for name, p in first["params"].items():
            torch.testing.assert_close(other["params"][name], p, rtol=0, atol=0, msg=name)
