"""`barter compare`: the side-by-side study, methods x densities x seeds on one preset, each run trained by
`barter.training.train`.

Every run uses the preset's recipe and the same budget (the same epochs, hence the same optimizer steps); only
method, density and seed change. `<out>/compare.csv` holds one row per run, `<out>/compare.md` the table of
mean +- std over seeds of the final test accuracy and macro-F1, the training FLOPs F_total, and the final
per-layer widths (heads and FFN channels; BARTER's moved, Static's as initialised, the others full);
`<out>/compare.png` plots test accuracy against cumulative training FLOPs, one curve per method and density
(mean ± std over seeds at each epoch); `<out>/transfers.png` the probe loss around each transfer and its units' next
update sizes, seeds pooled (`barter.training.transfer_plot`). Below the table, compare.md pairs the runs of one
seed: every method against Static, and every wrapped method against each baseline, at the same density, with the
per-seed differences, an exact sign test and a paired-t 95% interval (`barter.training.paired`).
`--variants fade count0.5 ...` adds BARTER under named transfer options (`barter.transfer_policy.VARIANTS`, over
the preset's `barter_options`), a row each (`barter (fade)`), paired like barter.

Matched compute: each BARTER run is then continued with its topology fixed (`TrainConfig.continue_from`) up to
the F_total of the reference run with the same seed, `--matched-to dense` by default. The baselines (RigL, SET,
SNFS, SRigL, S²ViTE) train full-width tensors under masks, so their executed F_total equals Dense's and the default
reference is their budget too. S²ViTE's widths are the live units of its compact export (`<run>/compact`).

Runs live in `<out>/runs/<preset>-<method>-rho<density>-seed<seed>[-matched]`; a run found there with a
checkpoint is resumed (a finished one is only read back), so an interrupted study continues where it stopped.
The default is the full study (hours on a CPU); `--quick` is one density, one seed and one epoch.

    barter compare --quick
    barter compare --preset cct_cifar100 --data-dir DATA --seeds 0 1 2
"""
from __future__ import annotations

import argparse
import csv
import json
import statistics
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..baselines import METHODS as BASELINES
from ..transfer_policy import VARIANTS, variants_help
from .arguments import CommandParser
from .config import METHODS, ConfigError, TrainConfig, infer_dataset
from .errors import USER_ERRORS
from .figures import legend_beside, pyplot
from .paired import difference_cells, paired_difference
from .presets import DEFAULT_PRESET, PRESETS, preset

if TYPE_CHECKING:  # torch and the training loop are imported by the commands that run (`--help` needs neither)
    from .loop import RunResult

DEFAULT_METHODS = ("dense", "static", "barter", *BASELINES)
DEFAULT_DENSITIES = (0.1, 0.3, 0.5, 0.7)
DEFAULT_SEEDS = (0, 1, 2)
MATCHED = "barter (matched)"
REFERENCES = ("dense", *BASELINES)  # runs whose F_total a matched BARTER continuation may reach
_AFTER_BARTER = METHODS.index("barter") + 1
ROW_ORDER = (*METHODS[:_AFTER_BARTER], MATCHED, *(v.label for v in VARIANTS.values()),  # table rows: BARTER's
             *METHODS[_AFTER_BARTER:])  # continuation and variants after it
CSV_FIELDS = ("method", "density", "seed", "epochs", "steps", "acc", "macro_f1", "best_acc", "flops", "wall_s",
              "transfers", "widths", "run_dir")


@dataclass(frozen=True)
class Row:
    """One finished run: what was trained and how it ended."""

    method: str
    density: float
    seed: int
    result: RunResult
    widths: dict[str, dict[str, int]] | None  # topology.json of a wrapped run, S²ViTE's live units; None: full

    def csv(self) -> dict[str, object]:
        r = self.result
        return {"method": self.method, "density": self.density, "seed": self.seed, "epochs": r.epochs,
                "steps": r.steps, "acc": r.acc, "macro_f1": r.macro_f1, "best_acc": r.best_acc, "flops": r.flops,
                "wall_s": round(r.wall_s, 1), "transfers": r.transfers,
                "widths": "" if self.widths is None else json.dumps(self.widths), "run_dir": str(r.run_dir)}


def run(config: TrainConfig, name: str | None = None) -> RunResult:
    """Train `config` under `name` (default: its default name), or resume / read back the run of that name found on
    disk."""
    from .loop import train
    from .runlog import RunDir

    config = replace(config, name=name or config.default_name())
    path = Path(config.out_dir) / config.name
    return train(config, resume=RunDir(path).last.exists())


def compact_widths(run_dir: Path) -> dict[str, dict[str, int]] | None:
    """Per-group unit counts of a run's compact export (`<run>/compact/topology.json`), as topology.json has them."""
    topology = run_dir / "compact" / "topology.json"
    if not topology.is_file():
        return None
    widths: dict[str, dict[str, int]] = {}
    for group in json.loads(topology.read_text())["groups"]:
        widths[group["name"]] = {group["kind"]: group["count"]}
    return widths


def record(method: str, config: TrainConfig, result: RunResult) -> Row:
    topology = result.run_dir / "topology.json"
    widths = json.loads(topology.read_text()) if topology.is_file() else compact_widths(result.run_dir)
    print(f"{method:>16} rho {config.density:g} seed {config.seed}: acc {result.acc:.4f}  macro-F1 "
          f"{result.macro_f1:.4f}  F_total {result.flops:.4g}  {result.steps} steps  {result.wall_s:.0f}s",
          flush=True)
    return Row(method, config.density, config.seed, result, widths)


def study(base: TrainConfig, methods: list[str], densities: list[float], seeds: list[int],
          matched_to: str | None, variants: tuple[str, ...] = ()) -> list[Row]:
    """Every (method, density, seed) run (Dense once per seed: it has no density) and BARTER's under each named
    variant (`barter.transfer_policy.VARIANTS`, its options over the preset's), then the matched-compute
    continuation of every BARTER run."""
    rows: list[Row] = []
    for seed in seeds:
        for method in methods:
            for density in [1.0] if method == "dense" else densities:
                config = replace(base, method=method, density=density, seed=seed)
                rows.append(record(method, config, run(config)))
        for variant in (VARIANTS[name] for name in variants):
            for density in densities:
                config = replace(base, method="barter", density=density, seed=seed,
                                 barter_options={**base.barter_options, **variant.wrap_options()})
                name = f"{base.preset}-barter-{variant.name}-rho{density:g}-seed{seed}"
                rows.append(record(variant.label, config, run(config, name)))
    if matched_to is None or "barter" not in methods:
        return rows
    reference = {(r.seed, r.density): r.result for r in rows if r.method == matched_to}
    for row in [r for r in rows if r.method == "barter"]:
        ref = reference.get((row.seed, 1.0 if matched_to == "dense" else row.density))
        config = replace(base, method="barter", density=row.density, seed=row.seed,
                         continue_from=str(row.result.run_dir), flop_budget=float(ref.flops))
        try:
            rows.append(record(MATCHED, config, run(config)))
        except ConfigError as e:  # the BARTER run already spent the reference's budget
            print(f"{MATCHED:>16} rho {row.density:g} seed {row.seed}: skipped ({e})")
    return rows


def mean_std(values: list[float], fmt: str) -> str:
    if len(values) == 1:
        return format(values[0], fmt)
    return f"{format(statistics.mean(values), fmt)} ± {format(statistics.stdev(values), fmt)}"


def widths_cell(topologies: list[dict[str, dict[str, int]] | None]) -> str:
    """Per-layer heads and channels in model order, averaged over seeds: "heads 2-1 / channels 40-24"."""
    if topologies[0] is None:
        return "full"
    from fxsurgery import UnitKind  # torch with it: `--help` needs neither
    parts = []
    for kind in UnitKind:
        layers = [m for m, kinds in topologies[0].items() if kind in kinds]
        means = [statistics.mean(t[m][kind] for t in topologies) for m in layers]
        parts.append(f"{kind}s " + "-".join(f"{x:g}" if x == int(x) else f"{x:.1f}" for x in means))
    return " / ".join(parts)


def markdown(rows: list[Row], base: TrainConfig, matched_to: str | None) -> str:
    """The study's table: one line per (method, density), mean ± std over its seeds."""
    groups: dict[tuple[str, float], list[Row]] = {}
    for r in rows:
        groups.setdefault((r.method, r.density), []).append(r)
    dense = [r.result.flops for r in rows if r.method == "dense"]
    lines = [f"Preset `{base.preset}` ({base.model} on {base.dataset}), epochs per run: {base.epochs}; test "
             f"accuracy and macro-F1 at the end of training, mean ± std over seeds. F_total: executed training "
             f"FLOPs (the baselines run dense kernels under masks; S²ViTE's widths: its compact export's live units)."
             + (f" {MATCHED}: BARTER continued with its topology fixed up to the F_total of {matched_to} "
                f"(same seed)." if any(r.method == MATCHED for r in rows) else ""),
             "",
             "| method | density | seeds | steps | accuracy | macro-F1 | F_total | × dense | widths |",
             "|---|---|---|---|---|---|---|---|---|"]
    for (method, density), group in sorted(groups.items(), key=lambda kv: (kv[0][0] != "dense", kv[0][1],
                                                                          ROW_ORDER.index(kv[0][0]))):
        flops = statistics.mean(r.result.flops for r in group)
        relative = f"{flops / statistics.mean(dense):.3f}" if dense else "-"
        lines.append(
            f"| {method} | {density:g} | {len(group)} | {statistics.mean(r.result.steps for r in group):g} | "
            f"{mean_std([r.result.acc for r in group], '.4f')} | "
            f"{mean_std([r.result.macro_f1 for r in group], '.4f')} | {flops:.3e} | {relative} | "
            f"{widths_cell([r.widths for r in group])} |")
    return "\n".join(lines + paired_markdown(rows)) + "\n"


def comparisons(methods: set[str]) -> list[tuple[str, str]]:
    """(method, reference) pairs of the paired table: every method against Static, and Static, BARTER and the
    other wrapped methods against each baseline (Dense has no density to pair at)."""
    wrapped = [m for m in ROW_ORDER if m in methods and m not in ("dense", *BASELINES)]
    pairs = [(m, "static") for m in ROW_ORDER if m in methods and m not in ("dense", "static")]
    pairs += [(m, b) for b in BASELINES if b in methods for m in wrapped]
    return pairs if "static" in methods else [p for p in pairs if p[1] != "static"]


def paired_markdown(rows: list[Row]) -> list[str]:
    """Lines of the paired table: per (method, reference, density), the seeds both ran and the per-seed
    differences in test accuracy and macro-F1 (percentage points)."""
    results: dict[tuple[str, float], dict[int, RunResult]] = {}
    for r in rows:
        results.setdefault((r.method, r.density), {})[r.seed] = r.result
    lines = []
    for method, reference in comparisons({m for m, _ in results}):
        for density in sorted({d for m, d in results if m == method}):
            ours, theirs = results[(method, density)], results.get((reference, density), {})
            unequal = sorted(s for s in ours.keys() & theirs.keys() if ours[s].steps != theirs[s].steps)
            if unequal:  # different budgets are not a paired difference
                lines.append(f"| {method} | {reference} | {density:g} | {len(unequal)} | budgets differ: "
                             + ", ".join(f"{ours[s].steps} vs {theirs[s].steps} steps" for s in unequal)
                             + " | | | | | | | |")
                ours = {s: r for s, r in ours.items() if s not in unequal}
            acc = paired_difference({s: r.acc for s, r in ours.items()}, {s: r.acc for s, r in theirs.items()})
            if acc is None:
                continue
            f1 = paired_difference({s: r.macro_f1 for s, r in ours.items()},
                                   {s: r.macro_f1 for s, r in theirs.items()})
            lines.append(f"| {method} | {reference} | {density:g} | {len(acc.seeds)} | "
                         + " | ".join(difference_cells(acc) + difference_cells(f1)) + " |")
    if not lines:
        return []
    return ["", "Paired differences, method − reference over the seeds both ran, in percentage points of test "
            "accuracy and macro-F1: per seed, mean [paired-t 95% interval], exact two-sided sign test p and paired "
            "t-test p.", "",
            "| method | reference | density | seeds | Δ acc per seed | Δ acc mean [95% CI] | sign p | t p | "
            "Δ F1 per seed | Δ F1 mean [95% CI] | sign p | t p |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|", *lines]


def write(out: Path, rows: list[Row], table: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with (out / "compare.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        writer.writeheader()
        writer.writerows(r.csv() for r in rows)
    (out / "compare.md").write_text(table)


def plot(path: Path, rows: list[Row]) -> None:
    """compare.png: `compare_figure`."""
    from .runlog import save_figure

    save_figure(compare_figure(rows), path)


def compare_figure(rows: list[Row]) -> Any:
    """Test accuracy against cumulative training FLOPs, one curve per (method, density): the mean over seeds at
    each epoch with a ± std band; a curve of one epoch is a point labelled with its accuracy (± std as an error
    bar). The legend sits beside the axes, off the data."""
    import torch

    from .runlog import RunDir

    groups: dict[tuple[str, float], list[list[dict]]] = {}
    for r in rows:
        groups.setdefault((r.method, r.density), []).append(RunDir(r.result.run_dir).metrics())
    fig, ax = pyplot().subplots(figsize=(7, 4.5))
    for (method, density), curves in sorted(groups.items(), key=lambda kv: (ROW_ORDER.index(kv[0][0]), kv[0][1])):
        epochs = min(len(c) for c in curves)
        if epochs == 0:
            continue
        flops = torch.tensor([[c[i]["flops"] for i in range(epochs)] for c in curves], dtype=torch.float64)
        acc = torch.tensor([[c[i]["acc"] for i in range(epochs)] for c in curves], dtype=torch.float64)
        x, y = flops.mean(0).numpy(), acc.mean(0).numpy()
        std = acc.std(0).numpy() if len(curves) > 1 else None
        label = method if method == "dense" else f"{method} ρ={density:g}"
        (line,) = ax.plot(x, y, marker="o", markersize=3 if epochs > 1 else 7, label=label)
        if epochs == 1:
            if std is not None:
                ax.errorbar(x, y, yerr=std, color=line.get_color(), capsize=3)
            ax.annotate(f"{y[0]:.3f}", (x[0], y[0]), xytext=(6, 4), textcoords="offset points", fontsize=8,
                        color=line.get_color())
        elif std is not None:
            ax.fill_between(x, y - std, y + std, color=line.get_color(), alpha=0.2)
    ax.set_xlabel("cumulative training FLOPs (F_total)")
    ax.set_ylabel("test accuracy")
    ax.set_xscale("log")
    ax.set_title("test accuracy against training compute (mean ± std over seeds)")
    ax.grid(alpha=0.3)
    legend_beside(ax, "method")
    return fig


def transfer_events(rows: list[Row]) -> dict[str, list[dict]]:
    """{"method ρ=density": the events.jsonl records of its runs, seeds pooled} for transfers.png (a matched
    continuation repeats its run's transfers: left out)."""
    pooled: dict[str, list[dict]] = {}
    for r in sorted(rows, key=lambda r: (ROW_ORDER.index(r.method), r.density)):
        path = r.result.run_dir / "events.jsonl"
        if r.method != MATCHED and path.is_file():
            events = [json.loads(line) for line in path.read_text().splitlines()]
            pooled.setdefault(f"{r.method} ρ={r.density:g}", []).extend(events)
    return pooled


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The study's options (shared by `barter compare` and `benchmarks/compare.py`)."""
    p.add_argument("--preset", choices=list(PRESETS), default=DEFAULT_PRESET,
                   help=f"training setup of every run (default {DEFAULT_PRESET}: MNIST-5k)")
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(DEFAULT_METHODS), metavar="METHOD",
                   help=f"any of {', '.join(METHODS)} (default: {' '.join(DEFAULT_METHODS)})")
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=[], metavar="VARIANT",
                   help=f"also BARTER under named transfer options, a row each paired like barter: any of "
                        f"{variants_help()} (default: none)")
    p.add_argument("--densities", nargs="+", type=float, default=list(DEFAULT_DENSITIES), metavar="RHO")
    p.add_argument("--seeds", nargs="+", type=int, default=list(DEFAULT_SEEDS))
    p.add_argument("--epochs", type=int, help="epochs of every run (default: the preset's)")
    p.add_argument("--matched-to", default="dense", choices=[*REFERENCES, "none"],
                   help="reference whose F_total the BARTER continuation reaches (default dense; none: skip)")
    p.add_argument("--dataset", help="override the preset's data set (cifar100, tiny-imagenet, mnist5k, fake, folder)")
    p.add_argument("--data-dir", help="where the data set lives (default: the preset's)")
    p.add_argument("--init-from", help="dense run or checkpoint to fine-tune (presets that need one)")
    p.add_argument("--device", default="auto", help="auto (default), cpu, cuda, ...")
    p.add_argument("--workers", type=int, help="data loader processes (default: the preset's)")
    p.add_argument("--threads", type=int,
                   help="torch CPU threads (default: torch's, all cores); 1 is fastest on a shared machine")
    p.add_argument("--out", default="runs/compare", help="output folder (default runs/compare)")
    p.add_argument("--quick", action="store_true",
                   help="smoke study: density 0.5, seed 0, 1 epoch of the mnist5k_quick preset")


def add_command(sub: argparse._SubParsersAction) -> None:
    """`barter compare` among the `barter` command's subparsers."""
    p = sub.add_parser("compare", help="side-by-side study of methods x densities x seeds (resumable)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog="example:\n  barter compare --quick --out runs/compare\n"
                              "  barter compare --methods dense static barter --densities 0.3 --seeds 0 1")
    add_arguments(p)
    p.set_defaults(run=run_study)


def run_study(args: argparse.Namespace) -> int:
    """Run (or resume) the study `args` describe and write compare.csv, compare.md and compare.png."""
    if args.quick:
        args.preset, args.densities, args.seeds, args.epochs = DEFAULT_PRESET, [0.5], [0], 1
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    matched_to = None if args.matched_to == "none" else args.matched_to
    if matched_to is not None and "barter" in args.methods and matched_to not in args.methods:
        raise ConfigError(f"--matched-to {matched_to} needs {matched_to} among --methods (or --matched-to none)")
    overrides = {k: v for k, v in (("epochs", args.epochs), ("dataset", args.dataset), ("data_dir", args.data_dir),
                                   ("init_from", args.init_from), ("workers", args.workers)) if v is not None}
    base = infer_dataset(replace(preset(args.preset), device=args.device, progress=False,
                                 out_dir=str(Path(args.out) / "runs"), **overrides), overrides)
    base.validate()
    rows = study(base, args.methods, args.densities, args.seeds, matched_to,
                 tuple(dict.fromkeys(args.variants)))
    table = markdown(rows, base, matched_to)
    out = Path(args.out)
    write(out, rows, table)
    plot(out / "compare.png", rows)
    from .transfer_plot import plot_transfers

    plot_transfers(out / "transfers.png", transfer_events(rows))
    print(f"\n{table}\nwrote {out / 'compare.csv'}, {out / 'compare.md'}, {out / 'compare.png'} and "
          f"{out / 'transfers.png'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """The study as a script (`benchmarks/compare.py`): the options of `barter compare`."""
    parser = CommandParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run_study(args)
    except USER_ERRORS as e:
        parser.exit(2, f"compare: error: {e}\n")
