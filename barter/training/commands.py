"""The `barter explain`, `barter eval` and `barter export` commands: look into a model, score a run, ship it."""
from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import CheckpointError

if TYPE_CHECKING:  # each command imports what it runs on: building the parser imports no torch
    import torch

CHECKPOINTS = ("best", "last")


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Add explain, eval and export to the `barter` command's subparsers."""
    explain = _add(sub, "explain", "print the unit groups fxsurgery finds in a timm model",
                   "barter explain vit_tiny_patch16_224\n  barter explain cct_2_3x1_32_tiny --img-size 32")
    explain.add_argument("model", help="a timm model name (the project's models are registered)")
    explain.add_argument("--img-size", type=int, help="build the model for this image size")
    explain.add_argument("--in-chans", type=int, help="build the model for this many image channels")
    explain.set_defaults(run=run_explain)

    evaluate = _add(sub, "eval", "evaluate a run's checkpoint on its test (and validation) split",
                    "barter eval runs/mnist5k_quick-barter-rho0.3-seed0\n  barter eval runs/NAME --checkpoint last")
    evaluate.add_argument("run_dir", metavar="RUN", help="run directory (or one of its checkpoint directories)")
    evaluate.add_argument("--checkpoint", choices=CHECKPOINTS, default="best", help="which checkpoint (default best)")
    evaluate.add_argument("--data-dir", help="where the data set lives now (default: the run's)")
    evaluate.add_argument("--device", default="auto", help="auto (default), cpu, cuda, ...")
    evaluate.set_defaults(run=run_eval)

    ship = _add(sub, "export", "write a run's compact model as a barter.export directory (no trainer state)",
                "barter export runs/NAME model/\n  python -c \"import barter; print(barter.load('model'))\"")
    ship.add_argument("run_dir", metavar="RUN", help="run directory (or one of its checkpoint directories)")
    ship.add_argument("out", metavar="OUT", help="directory to write (replaced atomically)")
    ship.add_argument("--checkpoint", choices=CHECKPOINTS, default="best", help="which checkpoint (default best)")
    ship.set_defaults(run=run_export)


def _add(sub: argparse._SubParsersAction, name: str, summary: str, example: str) -> argparse.ArgumentParser:
    return sub.add_parser(name, help=summary, description=summary[0].upper() + summary[1:] + ".",
                          epilog=f"example:\n  {example}", formatter_class=argparse.RawDescriptionHelpFormatter)


def run_explain(args: argparse.Namespace) -> int:
    import torch

    from fxsurgery import Surgeon

    from ..rebuild import timm_with_models

    kwargs = {key: value for key, value in (("img_size", args.img_size), ("in_chans", args.in_chans)) if value}
    try:
        model = timm_with_models().create_model(args.model, pretrained=False, **kwargs)
    except RuntimeError as e:
        raise CheckpointError(f"cannot build {args.model!r}: {e}") from e
    chans, *size = model.pretrained_cfg.get("input_size", (3, 224, 224))
    chans = args.in_chans or chans
    size = [args.img_size] * 2 if args.img_size else size
    print(Surgeon(model, (torch.randn(1, chans, *size),)).explain())
    return 0


def run_eval(args: argparse.Namespace) -> int:
    from .config import read_run_config
    from .evaluation import evaluate
    from .session import build_data, resolve_device

    run, checkpoint = _run_and_checkpoint(args.run_dir, args.checkpoint)
    config = read_run_config(run)
    if args.data_dir:
        config = replace(config, data_dir=args.data_dir)
    device = resolve_device(args.device)
    data = build_data(config)
    model = _load(checkpoint, device)
    results = {"checkpoint": str(checkpoint), "test": evaluate(model, data.test, data.num_classes, device, 0)}
    if data.val is not None:
        results["val"] = evaluate(model, data.val, data.num_classes, device, 0)
    print(json.dumps(results, indent=2))
    return 0


def run_export(args: argparse.Namespace) -> int:
    import torch

    from ..serialization import ExportError, export

    _, checkpoint = _run_and_checkpoint(args.run_dir, args.checkpoint)
    model = _load(checkpoint, torch.device("cpu"))
    try:
        path = export(model, args.out)
    except ExportError as e:
        raise CheckpointError(str(e)) from e
    print(f"{checkpoint} -> {path} ({sum(p.numel() for p in model.parameters()):,} parameters)")
    return 0


def _run_and_checkpoint(source: str, kind: str) -> tuple[Path, Path]:
    """The run directory and the checkpoint directory that `source` (either of them) names."""
    from .runlog import find_checkpoint

    checkpoint = find_checkpoint(source, kind)
    run = checkpoint.parent if checkpoint != Path(source) / kind else Path(source)
    if not checkpoint.is_dir():
        raise CheckpointError(f"no {kind} checkpoint at {checkpoint}")
    return run, checkpoint


def _load(checkpoint: Path, device: torch.device) -> torch.nn.Module:
    from ..serialization import ExportError, load

    try:
        return load(checkpoint, device=device)
    except ExportError as e:
        raise CheckpointError(str(e)) from e
