"""Which part of a transfer costs or earns accuracy: BARTER under named transfer-policy variants against Static at
the same density, step budget and seeds, from scratch (preset `mnist5k_quick` by default).

Variants (`barter.transfer_policy.VARIANTS`, sets of `barter.wrap` options): paper (the paper's policy), carry and
restart (optimizer state at a clone), fade (the donor faded out over its cooldown), removals and clones (one part of a
transfer only), count0.5 and count2 (transfer counts times 0.5 / 2). Static is run at every density and seed as the
reference.
Each run is `barter.training.train` of the preset under `OUT/runs/<preset>-<variant>-rho<density>-seed<seed>`, and
its result is appended to OUT/transfers.jsonl as it finishes; `--resume` skips the runs found there (a run cut
short resumes from its last checkpoint). OUT/transfers.md holds the table: per variant and density, test accuracy
(mean ± sd), the paired difference variant − Static per seed, its mean [paired-t 95% interval], the exact sign
test's p and the paired t-test's p (`barter.training.paired`), and, from the run's events.jsonl, the mean probe-loss
jump (`probe_loss_after` − `probe_loss_before`) and the mean difference 100 steps after (`probe_loss_100` −
`probe_loss_before`) over the transfers that recorded them.

    .venv/bin/python benchmarks/transfers.py --densities 0.3 --variants paper carry fade --threads 1
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from barter.training import TrainConfig, preset  # noqa: E402
from barter.training.arguments import CommandParser  # noqa: E402
from barter.training.compare import mean_std  # noqa: E402
from barter.training.paired import difference_cells, paired_difference  # noqa: E402
from barter.training.presets import DEFAULT_PRESET, PRESETS  # noqa: E402
from barter.training.transfer_plot import probed  # noqa: E402
from barter.transfer_policy import VARIANTS, variants_help  # noqa: E402

REFERENCE = "static"


@dataclass(frozen=True)
class Result:
    """One finished run, as a line of transfers.jsonl."""

    variant: str
    density: float
    seed: int
    acc: float
    macro_f1: float
    steps: int
    transfers: int
    jump: float | None  # mean probe_loss_after - probe_loss_before over its transfers
    recovery: float | None  # mean probe_loss_100 - probe_loss_before over the transfers that reached it
    wall_s: float

    @property
    def key(self) -> tuple[str, float, int]:
        return self.variant, self.density, self.seed


def mean_difference(events: list[dict], field: str) -> float | None:
    """Mean of `field` − probe_loss_before over the probed transfers that recorded `field`; None without any."""
    values = [e[field] - e["probe_loss_before"] for e in probed(events) if e.get(field) is not None]
    return statistics.fmean(values) if values else None


def config_of(base: TrainConfig, variant: str, density: float, seed: int) -> TrainConfig:
    """The run of `variant` (or Static) at `density` and `seed`, named after all three."""
    method, options = (REFERENCE, {}) if variant == REFERENCE else ("barter", VARIANTS[variant].wrap_options())
    return replace(base, method=method, density=density, seed=seed, barter_options=options,
                   name=f"{base.preset}-{variant}-rho{density:g}-seed{seed}")


def run(config: TrainConfig, variant: str) -> Result:
    """Train `config` (resuming its directory's last checkpoint if there is one) and read its events back."""
    from barter.training import train
    from barter.training.runlog import RunDir

    run_dir = RunDir(Path(config.out_dir) / config.name)
    result = train(config, resume=run_dir.last.exists())
    events_file = result.run_dir / "events.jsonl"
    events = [json.loads(line) for line in events_file.read_text().splitlines()] if events_file.is_file() else []
    return Result(variant, config.density, config.seed, result.acc, result.macro_f1, result.steps, result.transfers,
                  mean_difference(events, "probe_loss_after"), mean_difference(events, "probe_loss_100"),
                  round(result.wall_s, 1))


def read_results(path: Path) -> list[Result]:
    return [Result(**json.loads(line)) for line in path.read_text().splitlines()] if path.is_file() else []


def loss_cell(values: list[float | None]) -> str:
    known = [v for v in values if v is not None]
    return f"{statistics.fmean(known):+.4f}" if known else "-"


def markdown(results: list[Result], base: TrainConfig) -> str:
    """The study's table: one line per (variant, density), its paired difference against Static."""
    groups: dict[tuple[str, float], dict[int, Result]] = {}
    for r in results:
        groups.setdefault((r.variant, r.density), {})[r.seed] = r
    order = [REFERENCE, *VARIANTS]
    lines = [f"Preset `{base.preset}` ({base.model} on {base.dataset}), {base.epochs} epochs per run, from scratch. "
             "Accuracy: test accuracy at the end of training, mean ± sd over seeds. Δ vs static: variant − Static "
             "over the seeds both ran with the same steps, in percentage points: per seed, mean [paired-t 95% "
             "interval], exact two-sided sign test p, paired t-test p. Jump: mean probe loss just after a transfer "
             "minus just before; +100: 100 optimizer steps after minus just before (transfers that reached it).",
             "",
             "| variant | density | seeds | steps | transfers | accuracy | Δ acc per seed | Δ acc mean [95% CI] | "
             "sign p | t p | jump | +100 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (variant, density), runs in sorted(groups.items(), key=lambda kv: (kv[0][1], order.index(kv[0][0]))):
        reference = groups.get((REFERENCE, density), {})
        unequal = sorted(s for s in runs.keys() & reference.keys() if runs[s].steps != reference[s].steps)
        pairs = {s: r.acc for s, r in runs.items() if s not in unequal}
        difference = None if variant == REFERENCE else paired_difference(
            pairs, {s: r.acc for s, r in reference.items()})
        cells = ["-"] * 4 if difference is None else difference_cells(difference)
        if unequal:  # different budgets are no paired difference
            cells[0] = "budgets differ at seed(s) " + ", ".join(map(str, unequal)) + "; " + cells[0]
        values = list(runs.values())
        lines.append(f"| {variant} | {density:g} | {len(values)} | {statistics.mean(r.steps for r in values):g} | "
                     f"{statistics.mean(r.transfers for r in values):g} | "
                     f"{mean_std([r.acc for r in values], '.4f')} | " + " | ".join(cells) + " | "
                     f"{loss_cell([r.jump for r in values])} | {loss_cell([r.recovery for r in values])} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = CommandParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=list(PRESETS), default=DEFAULT_PRESET,
                        help=f"training setup of every run (default {DEFAULT_PRESET}: MNIST-5k from scratch)")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS), metavar="VARIANT",
                        help=f"any of {variants_help()} (default: all); Static always runs as the reference")
    parser.add_argument("--densities", nargs="+", type=float, default=[0.3, 0.5], metavar="RHO")
    parser.add_argument("--seeds", nargs="+", type=int, default=list(range(8)))
    parser.add_argument("--epochs", type=int, help="epochs of every run (default: the preset's)")
    parser.add_argument("--dataset", help="override the preset's data set (e.g. fake)")
    parser.add_argument("--device", default="auto", help="auto (default), cpu, cuda, ...")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's); 1 on a shared machine")
    parser.add_argument("--out", default="runs/transfers", help="output folder (default runs/transfers)")
    parser.add_argument("--resume", action="store_true", help="skip the runs already in OUT/transfers.jsonl")
    args = parser.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    overrides = {k: v for k, v in (("epochs", args.epochs), ("dataset", args.dataset)) if v is not None}
    base = replace(preset(args.preset), device=args.device, progress=False, out_dir=str(out / "runs"), **overrides)
    base.validate()
    log = out / "transfers.jsonl"
    if not args.resume:
        log.unlink(missing_ok=True)
    results = read_results(log)
    done = {r.key for r in results}
    for density in args.densities:
        for seed in args.seeds:
            for variant in [REFERENCE, *args.variants]:
                if (variant, density, seed) in done:
                    continue
                result = run(config_of(base, variant, density, seed), variant)
                print(f"{variant:>9} rho {density:g} seed {seed}: acc {result.acc:.4f}  {result.steps} steps  "
                      f"{result.transfers} transfers  {result.wall_s:.0f}s", flush=True)
                with log.open("a") as f:
                    f.write(json.dumps(result.__dict__) + "\n")
                results.append(result)
                done.add(result.key)
    wanted = {(v, d, s) for d in args.densities for s in args.seeds for v in [REFERENCE, *args.variants]}
    table = markdown([r for r in results if r.key in wanted], base)
    (out / "transfers.md").write_text(table)
    print(f"\n{table}\nwrote {log} and {out / 'transfers.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
