"""How long the `barter` command takes to answer without training: `barter --help`, `barter train --help` and an
argument error (`barter train --dnsity 0.5`), each run as a fresh process (`python -m barter`, the checkout's code),
`--runs` times; prints the median wall time of each against the limit (1.0 s) with PASS or FAIL, and the machine's
load average, which the times follow on a shared machine.

Answering costs the interpreter's start and building the parser: neither imports torch (`barter.lazy`;
tests/training/test_cli_startup.py keeps it so). `python -X importtime -m barter --help` shows what is imported.

    .venv/bin/python benchmarks/cli_startup.py [--runs 5] [--limit 1.0]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# (what is timed, its arguments, the exit status and a text of its output that show it answered as it should)
CASES = (
    ("barter --help", ["--help"], 0, "usage: barter"),
    ("barter train --help", ["train", "--help"], 0, "usage: barter train"),
    ("barter train --dnsity 0.5", ["train", "--dnsity", "0.5"], 2, "did you mean --density?"),
)


def wall_time(arguments: list[str], status: int, expected: str) -> float:
    """Seconds one `python -m barter ARGUMENTS` process takes; its exit status and output are checked."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "barter", *arguments], cwd=ROOT, env=env, capture_output=True,
                          text=True)
    seconds = time.perf_counter() - start
    if done.returncode != status or expected not in done.stdout + done.stderr:
        raise SystemExit(f"barter {' '.join(arguments)}: exit status {done.returncode} (expected {status}), "
                         f"output without {expected!r}:\n{done.stdout}{done.stderr}")
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5, help="processes per command (default 5)")
    parser.add_argument("--limit", type=float, default=1.0, help="seconds a median may take (default 1.0)")
    args = parser.parse_args()
    print(f"{args.runs} runs each, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} before")
    passed = True
    for name, arguments, status, expected in CASES:
        times = [wall_time(arguments, status, expected) for _ in range(args.runs)]
        median = statistics.median(times)
        passed &= median <= args.limit
        print(f"{name:<28} median {median:.3f} s (min {min(times):.3f}, max {max(times):.3f})  "
              f"{'PASS' if median <= args.limit else 'FAIL'} (limit {args.limit:g} s)")
    print(f"load average {os.getloadavg()[0]:.2f} after")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
