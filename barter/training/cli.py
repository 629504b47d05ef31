"""The `barter` command: `train`, `explain`, `eval`, `export` and `compare` (`barter COMMAND --help` for each).

`barter train` with no arguments trains the `mnist5k_quick` preset. Every `TrainConfig` field is a flag
(`--weight-decay 0.1`, `--model-kwargs '{num_heads: 4}'`, `--no-progress`), and so is every `barter.wrap`
option (`--beta`, `--window 0.1 0.4`, ...). `-c FILE` reads fields from a YAML or JSON file; the preset
fills what the file leaves out, flags override both, and `--print-config` shows the result without training.
`--resume runs/NAME` continues an interrupted run from its last checkpoint with the run's own config.json;
`--continue-from runs/NAME --flop-budget B` continues a finished run's endpoint up to B cumulative training
FLOPs (matched compute). B is a number or the directory of the baseline run whose cumulative FLOPs to match.
Under `torchrun --nproc_per_node=N -m barter train ...` the N processes train one run with DistributedDataParallel.
"""
from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..options import ALLOCATIONS, INITS, Options
from ..transfer_policy import POLICY_ENUMS
from . import commands, compare
from .arguments import CommandParser
from .config import (
    CHOICES,
    FIELD_HELP,
    ConfigError,
    TrainConfig,
    coerce_barter_options,
    coerce_fields,
    field_types,
    infer_dataset,
    read_config_file,
    read_run_config,
)
from .errors import USER_ERRORS
from .flags import add_field_flags, field_values
from .presets import DEFAULT_PRESET, NEEDS_INIT, PRESETS, preset

OPTION_PREFIX = "barter_option_"  # namespace prefix of the barter.wrap option flags
OPTION_HELP = {
    "beta": "EMA decay of the scores",
    "window": "reallocation window START END, as fractions of training (default: the transfer policy's, 0.1 0.4)",
    "head_ratio": "head transfers per initial head", "channel_ratio": "channel transfers per initial channel",
    "noise_std": "split noise sigma", "noise_relative": "noise_std relative to the parent's output weights",
    "init": "which units compact initialisation keeps (score: largest D on --calibration batches)",
    "allocation": "initial widths: uniform (rho per layer) or global (units ranked across layers, same parameters)",
    "transfer_policy": "named policy setting every part of a transfer not given below (paper: the paper's)",
    "transfer_parts": "both parts of a transfer, or removals / clones only (widths end under / start under the "
                      "budget, which is never exceeded)",
    "count_scale": "transfer counts K times this (0.5, 2, 4, ...)",
    "clone_state": "optimizer state at a clone: paper (moments zeroed, step counter kept), carry (parent's moments, "
                   "output slices m/2 and v/4), restart (zeroed, Adam's bias correction restarted for them)",
    "min_heads": "the fewest heads a transfer leaves in an attention layer (paper: 0, a layer may lose every head)",
    "removal": "paper (donor removed at its transfer) or fade (its output weights faded to zero over its cooldown, "
               "then removed)",
}
RESUME_FIELDS = ("device", "workers", "progress")  # what a resumed run may change

TRAIN_EXAMPLES = """examples:
  barter train                                      # the mnist5k_quick preset
  barter train --preset cct_cifar100 --data-dir DATA --density 0.5 --weight-decay 0.06
  barter train -c my.yaml --seed 3 --print-config   # a YAML/JSON file of TrainConfig fields, flags win
  barter train --preset custom --dataset folder --data-dir DIR   # DIR/train/<class>/*, DIR/val/<class>/*
  barter train --resume runs/NAME
"""


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except USER_ERRORS as e:
        parser.exit(2, f"barter {args.command}: error: {e}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(prog="barter", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    train_parser = sub.add_parser("train", help="train a model (default preset: mnist5k_quick)",
                                  description="Train one run; every TrainConfig field is a flag.",
                                  epilog=TRAIN_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_train_arguments(train_parser)
    train_parser.set_defaults(run=run_train)
    commands.add_commands(sub)
    compare.add_command(sub)
    return parser


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-c", "--config", metavar="FILE", help="YAML or JSON file of TrainConfig fields")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    parser.add_argument("--resume", metavar="RUN", help="run directory to resume from its last checkpoint")
    fields = parser.add_argument_group("TrainConfig fields (default: the preset's)")
    choices = {"preset": (*PRESETS, TrainConfig.preset), **CHOICES}
    add_field_flags(fields, field_types(), helps=FIELD_HELP, choices=choices)
    options = parser.add_argument_group("barter.wrap options (TrainConfig.barter_options)")
    add_field_flags(options, field_types(Options), helps=OPTION_HELP,
                    choices={"init": INITS, "allocation": ALLOCATIONS,
                             **{name: tuple(m.value for m in kind) for name, kind in POLICY_ENUMS.items()}},
                    prefix=OPTION_PREFIX)


def run_train(args: argparse.Namespace) -> int:
    from .loop import train
    from .processes import is_main

    config, resume = config_from_args(args)
    if config.preset in NEEDS_INIT and config.init_from is None and not resume:
        raise ConfigError(f"preset {config.preset} fine-tunes a checkpoint: pass --init-from RUN_OR_FILE")
    config.validate()
    if args.print_config:
        import yaml

        print(yaml.safe_dump(config.to_dict(), sort_keys=False), end="")
        return 0
    result = train(config, resume=resume, header=print)
    if is_main() and result.already_finished:
        print(f"{result.run_dir} has finished (epoch {result.epochs:g}): nothing to resume, no file changed; "
              f"--continue-from {result.run_dir} --flop-budget FLOPS trains it further")
    if is_main():
        print(f"{result.run_dir}: test acc {result.acc:.4f}, macro-F1 {result.macro_f1:.4f} after {result.epochs:g} "
              f"epochs ({result.steps} steps); best (epoch {result.best_epoch:g}) {result.best_acc:.4f}; "
              f"F_total {result.flops:.4g} FLOPs; {result.transfers} transfers; {result.wall_s:.0f}s")
    return 0


def config_from_args(args: argparse.Namespace) -> tuple[TrainConfig, bool]:
    """The TrainConfig the flags ask for (preset, then config file, then flags), and whether it resumes a run."""
    given = read_config_file(args.config) if args.config else {}
    flags = field_values(args, field_types())
    if "flop_budget" in flags:
        flags["flop_budget"] = flop_budget_value(flags["flop_budget"])
    given.update(coerce_fields(flags))
    options = coerce_barter_options(field_values(args, field_types(Options), OPTION_PREFIX))
    if args.resume:
        if set(given) - set(RESUME_FIELDS) or options:
            raise ConfigError(f"--resume takes the run's own config; only {sorted(RESUME_FIELDS)} may be overridden")
        run = Path(args.resume)
        return replace(read_run_config(run), out_dir=str(run.parent), name=run.name, **given), True
    if given.get("continue_from"):
        base = replace(read_run_config(Path(given["continue_from"])), name=None)
    else:
        base = _preset_or_defaults(given.get("preset", DEFAULT_PRESET))
    barter_options = {**given.pop("barter_options", base.barter_options), **options}  # option flags add to it
    return infer_dataset(replace(base, **given, barter_options=barter_options), given), False


def _preset_or_defaults(name: str) -> TrainConfig:
    """The preset `name`; "custom" (a config file of its own) starts from TrainConfig's defaults."""
    return TrainConfig() if name == TrainConfig.preset else preset(name)


def flop_budget_value(text: Any) -> Any:
    """A number of FLOPs, or the cumulative FLOPs in the last metrics line of a run directory."""
    if not isinstance(text, str):
        return text
    try:
        return float(text)
    except ValueError:
        pass
    from .runlog import RunDir

    metrics = RunDir(text).metrics()
    if not metrics:
        raise ConfigError(f"flop_budget: {text} is neither a number nor a run directory with metrics.jsonl")
    return float(metrics[-1]["flops"])
