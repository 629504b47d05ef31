"""The `barter` command: `barter train [--preset P] [overrides]` (no arguments: the `mnist5k_quick` preset).

`--resume runs/NAME` continues an interrupted run from its last checkpoint with the run's own config.json;
`--continue-from runs/NAME --flop-budget B` continues a finished run's endpoint up to B cumulative training
FLOPs (matched compute). B is a number or the directory of the baseline run whose cumulative FLOPs to match.
Under `torchrun --nproc_per_node=N -m barter train ...` the N processes train one run with DistributedDataParallel.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from .config import METHODS, ConfigError, TrainConfig
from .data import DatasetNotFoundError
from .loop import train
from .precision import AMP_MODES
from .presets import DEFAULT_PRESET, NEEDS_INIT, PRESETS, preset
from .processes import is_main
from .runlog import CheckpointError, RunDir

# flags that override the TrainConfig field of the same name
OVERRIDES = ("method", "density", "epochs", "seed", "device", "batch_size", "lr", "dataset", "data_dir", "model",
             "fake_size", "workers", "out_dir", "name", "init_from", "flop_budget", "amp")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config, resume = config_from_args(args)
        if config.preset in NEEDS_INIT and config.init_from is None and not resume:
            raise ConfigError(f"preset {config.preset} fine-tunes a checkpoint: pass --init-from RUN_OR_FILE")
        config.validate()
        result = train(config, resume=resume)
    except (ConfigError, CheckpointError, DatasetNotFoundError) as e:
        parser.exit(2, f"barter {args.command}: error: {e}\n")
    if is_main():
        print(f"{result.run_dir}: test acc {result.acc:.4f}, macro-F1 {result.macro_f1:.4f} after {result.epochs:g} "
              f"epochs ({result.steps} steps); best (epoch {result.best_epoch:g}) {result.best_acc:.4f}; "
              f"F_total {result.flops:.4g} FLOPs; {result.transfers} transfers; {result.wall_s:.0f}s")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="barter", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help="train a model (default preset: mnist5k_quick)")
    p.add_argument("--preset", choices=list(PRESETS), default=DEFAULT_PRESET)
    p.add_argument("--method", choices=METHODS)
    p.add_argument("--density", type=_density, help="rho in (0, 1]: fraction of heads and channels kept")
    p.add_argument("--epochs", type=_positive_int)
    p.add_argument("--seed", type=int)
    p.add_argument("--device", help="auto (default), cpu, cuda, cuda:1, ...")
    p.add_argument("--amp", choices=AMP_MODES, help="mixed precision: fp32 (default), bf16, or fp16 with loss scaling")
    p.add_argument("--batch-size", type=_positive_int)
    p.add_argument("--lr", type=float)
    p.add_argument("--model", help="a timm model name (the project's models are registered)")
    p.add_argument("--dataset", help="cifar100, tiny-imagenet, mnist5k or fake")
    p.add_argument("--data-dir")
    p.add_argument("--fake-size", type=_positive_int, help="training images of the fake data set")
    p.add_argument("--workers", type=int, help="data loader processes")
    p.add_argument("--out-dir", help="parent of run directories (default runs)")
    p.add_argument("--name", help="run directory name (default: preset-method-rho-seed)")
    p.add_argument("--init-from", help="dense run directory or checkpoint to fine-tune (new classifier)")
    p.add_argument("--flop-budget", type=_flop_budget, help="stop at this cumulative F_total (FLOPs), or at the "
                   "final F_total of the run directory given")
    p.add_argument("--continue-from", help="finished run to continue with its topology fixed (matched compute)")
    p.add_argument("--resume", help="run directory to resume from its last checkpoint")
    p.add_argument("--no-progress", action="store_true", help="no progress bar or per-epoch lines")
    return parser


def config_from_args(args: argparse.Namespace) -> tuple[TrainConfig, bool]:
    """The TrainConfig the flags ask for, and whether it resumes a run."""
    overrides = {name: getattr(args, name) for name in OVERRIDES if getattr(args, name) is not None}
    if args.no_progress:
        overrides["progress"] = False
    if args.resume:
        allowed = {"device", "workers", "progress"}
        if set(overrides) - allowed:
            raise ConfigError(f"--resume takes the run's own config; only {sorted(allowed)} may be overridden")
        run = Path(args.resume)
        config = _saved_config(run)
        return replace(config, out_dir=str(run.parent), name=run.name, **overrides), True
    if args.continue_from:
        config = _saved_config(Path(args.continue_from))
        return replace(config, continue_from=args.continue_from, name=None, **overrides), False
    return replace(preset(args.preset), **overrides), False


def _saved_config(run: Path) -> TrainConfig:
    if not (run / "config.json").is_file():
        raise CheckpointError(f"{run} is not a run directory (no config.json)")
    return TrainConfig.from_dict(RunDir(run).read_json("config.json"))


def _density(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"density must be in (0, 1], got {text}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def _flop_budget(text: str) -> float:
    """A number of FLOPs, or a run directory whose last metrics line gives its cumulative FLOPs."""
    try:
        return float(text)
    except ValueError:
        pass
    metrics = Path(text) / "metrics.jsonl"
    if not metrics.is_file():
        raise argparse.ArgumentTypeError(f"{text} is neither a number nor a run directory with metrics.jsonl")
    return float(json.loads(metrics.read_text().splitlines()[-1])["flops"])
