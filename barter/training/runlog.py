"""A run's directory: config.json, metrics.jsonl, summary.csv, events.jsonl, topology.json, checkpoints, widths.png,
transfers.png (`barter.training.transfer_plot`), for S²ViTE `compact/`,
and TensorBoard event files under `tensorboard/` when the `tensorboard` package is installed.

summary.csv has one row per epoch, under timm's column names where timm has one (epoch, train_loss, eval_loss,
eval_top1, eval_top5 in percent as timm writes them, lr; under `model_ema` the EMA's ema_eval_top1 and
ema_eval_top5) and ours for the rest; it is rewritten from metrics.jsonl, so a resumed run's table is that of the
uninterrupted one. TensorBoard gets the same scalars against the step.

The checkpoints `best/` and `last/` are `barter.export` directories (`barter.load(run / "best")` gives the trained
compact model; under `model_ema` its EMA, which has the model's topology) with the trainer state beside the
weights in `trainer.pt`, a `torch.save` dictionary read back with `weights_only=True` (under `model_ema` it holds
the live model's and the EMA's whole states too). S²ViTE's `best/` and `last/` hold its masked full-width model
(resuming needs the dead units' input weights); `compact/` is the best one with the dead units removed. Each is
written atomically (a temporary directory, then renames); anything unreadable or incomplete raises `CheckpointError`
with the path and the reason.

Every checkpoint directory records its files with their sha256 in `manifest.json` (`barter.serialization`),
written last; reading a checkpoint checks every file against it and names the one that fails. Saving the last
checkpoint moves the one before it to `previous/`, kept until the new one is complete, so a run whose `last/`
is damaged, or was cut while being replaced, resumes from `previous/` (`barter.training.checkpoint`). A
metrics.jsonl whose last line a dying process left unfinished is read without it, and rewritten on resume.
"""
from __future__ import annotations

import csv
import io
import json
import os
import shutil
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fxsurgery import UnitKind

from ..serialization import MANIFEST, ExportError, read_export, replace_directory, verify_files, write_export
from .errors import CheckpointError
from .figures import legend_beside, pyplot

CHECKPOINT_KEYS = ("config", "epoch", "step", "finished", "optimizer", "rng", "flops")
TRAINER_STATE = "trainer.pt"
# summary.csv: timm's column (right) for a metrics.jsonl key (left); the other keys keep their names
TIMM_COLUMNS = {"epoch": "epoch", "loss": "train_loss", "test_loss": "eval_loss", "acc": "eval_top1",
                "top5": "eval_top5", "lr": "lr", "ema_test_acc": "ema_eval_top1", "ema_test_top5": "ema_eval_top5"}
PERCENT = ("acc", "top5", "ema_test_acc", "ema_test_top5")  # timm writes top-1/top-5 in percent


class RunDir:
    """The files of one run under `path` (created on demand)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._board: Any = None
        self._purge_step: int | None = None

    @property
    def last(self) -> Path:
        return self.path / "last"

    @property
    def previous(self) -> Path:
        """The last checkpoint before `last`, kept until the next one is complete."""
        return self.path / "previous"

    @property
    def best(self) -> Path:
        return self.path / "best"

    @property
    def compact(self) -> Path:
        """The physically compact export of a baseline that trains under unit masks (S²ViTE)."""
        return self.path / "compact"

    def write_json(self, name: str, data: Any) -> None:
        _atomic(self.path / name, lambda f: f.write_text(json.dumps(data, indent=2) + "\n"))

    def read_json(self, name: str) -> Any:
        return json.loads((self.path / name).read_text())

    def append_metrics(self, record: dict[str, Any]) -> None:
        """One line of metrics.jsonl (one per epoch), then summary.csv and the TensorBoard scalars."""
        with (self.path / "metrics.jsonl").open("a") as f:
            f.write(json.dumps(record) + "\n")
        self.write_summary()
        self._log_scalars(record)

    def write_summary(self) -> None:
        """summary.csv from metrics.jsonl: timm's column names where they exist (see the module docstring)."""
        rows = [{TIMM_COLUMNS.get(k, k): 100 * v if k in PERCENT and v is not None else v for k, v in r.items()}
                for r in self.metrics()]
        columns = list(TIMM_COLUMNS.values()) + [c for r in rows for c in r if c not in TIMM_COLUMNS.values()]
        text = io.StringIO()
        writer = csv.DictWriter(text, fieldnames=list(dict.fromkeys(columns)), extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
        _atomic(self.path / "summary.csv", lambda f: f.write_text(text.getvalue()))

    def _log_scalars(self, record: dict[str, Any]) -> None:
        """The record's numbers as TensorBoard scalars at its step (nothing without the tensorboard package)."""
        if self._board is None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                return
            self._board = SummaryWriter(str(self.path / "tensorboard"), purge_step=self._purge_step)
        for key, value in record.items():
            if isinstance(value, (int, float)) and key not in ("step",):
                self._board.add_scalar(TIMM_COLUMNS.get(key, key), value, record["step"])
        self._board.flush()

    def metrics(self) -> list[dict[str, Any]]:
        """metrics.jsonl's records, without an unfinished last line (a process that died writing it)."""
        path = self.path / "metrics.jsonl"
        if not path.exists():
            return []
        text = path.read_text()
        lines = text.splitlines()
        records = []
        for number, line in enumerate(lines, 1):
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                if number == len(lines) and not text.endswith("\n"):
                    break
                raise CheckpointError(f"{path} is damaged at line {number} ({e})") from None
        return records

    def truncate_metrics(self, epoch: float) -> None:
        """Keep only the lines up to `epoch` (a resumed run rewrites what followed its checkpoint)."""
        kept = [r for r in self.metrics() if r["epoch"] <= epoch]
        _atomic(self.path / "metrics.jsonl", lambda f: f.write_text("".join(json.dumps(r) + "\n" for r in kept)))
        self.write_summary()
        self._purge_step = kept[-1]["step"] + 1 if kept else 0  # TensorBoard drops the scalars logged after it

    def write_events(self, events: Iterable[Mapping[str, Any]]) -> None:
        """events.jsonl: every attempted transfer (skipped ones say why), rewritten whole, so the fields measured
        after a transfer (`barter.transfer_probe`) appear once known."""
        _atomic(self.path / "events.jsonl", lambda f: f.write_text("".join(json.dumps(dict(e)) + "\n" for e in events)))

    def events(self) -> list[dict[str, Any]]:
        """events.jsonl's records (none for a method that moves no units)."""
        path = self.path / "events.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def save_checkpoint(self, model: nn.Module, state: dict[str, Any], **export_options: Any) -> None:
        """Make `last` an export of `model` (`export_options`: those of `barter.export`) with the trainer `state`
        beside its weights; the one it replaces becomes `previous`."""

        def fill(directory: Path) -> None:
            write_export(model, directory, **export_options)
            torch.save(state, directory / TRAINER_STATE)

        replace_directory(self.last, fill, keep=self.previous)

    def copy_checkpoint(self, source: Path, target: Path) -> None:
        """Make `target` a copy of the checkpoint `source` (atomically, as `save_checkpoint` writes)."""
        replace_directory(target, lambda directory: shutil.copytree(source, directory, dirs_exist_ok=True))


def load_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a checkpoint written by `RunDir.save_checkpoint`, every file verified against its manifest: the
    trainer state, with the weights under "model" and the directory under "path"."""
    path = Path(path)
    if not _is_checkpoint(path):
        raise CheckpointError(f"no checkpoint at {path}")
    try:
        verify_files(path)
        state = torch.load(path / TRAINER_STATE, map_location="cpu", weights_only=True)
        _, weights = read_export(path)
    except ExportError as e:
        raise CheckpointError(f"cannot read checkpoint {path} ({e})") from e
    except Exception as e:  # torch.load raises many types for a foreign file
        raise CheckpointError(f"cannot read checkpoint {path} ({type(e).__name__}: {e})") from e
    missing = [k for k in CHECKPOINT_KEYS if not isinstance(state, dict) or k not in state]
    if missing:
        raise CheckpointError(f"{path} is not a barter training checkpoint (missing: {', '.join(missing)})")
    return {**state, "model": weights, "path": path}


def find_checkpoint(source: str | os.PathLike[str], kind: str = "last") -> Path:
    """`source` itself if it is a checkpoint directory, else `<source>/<kind>` (a run directory)."""
    source = Path(source)
    return source if _is_checkpoint(source) else source / kind


def _is_checkpoint(path: Path) -> bool:
    """Whether `path` is a checkpoint directory, however damaged (its trainer state or its manifest is there)."""
    return (path / TRAINER_STATE).is_file() or (path / MANIFEST).is_file()


def width_history(final: dict[str, dict[str, int]], events: Sequence[Mapping[str, Any]]
                  ) -> dict[str, dict[str, list[tuple[int, int]]]]:
    """{kind: {group name: [(step, width), ...]}} from the final topology and the executed transfers.

    Replaying the transfers backwards from the final widths gives the initial ones; each executed transfer
    then takes one unit of its kind from the donor layer (at its step, or when a fading donor is removed) and
    gives one to the receiver layer (at its step); a transfer that ran one part only changes one layer.
    """
    done = [e for e in events if e["skipped"] is None]
    removals = [(e.get("removed_at", e["step"]), e["donor_group"], e["kind"], -1) for e in done]
    clones = [(e["step"], e["receiver_group"], e["kind"], +1) for e in done]
    changes = sorted(change for change in removals + clones if change[1] is not None)
    width = {(module, kind): n for module, kinds in final.items() for kind, n in kinds.items()}
    for _, group, kind, change in changes:
        width[(group, kind)] -= change
    history: dict[str, dict[str, list[tuple[int, int]]]] = {}
    for (module, kind), n in width.items():
        history.setdefault(kind, {})[module] = [(0, n)]
    for step, group, kind, change in changes:
        series = history[kind][group]
        series.append((step, series[-1][1] + change))
    return history


def plot_widths(path: Path, final: dict[str, dict[str, int]], events: Sequence[Mapping[str, Any]],
                steps_per_epoch: int, last_step: int, title: str) -> None:
    """widths.png: `widths_figure`."""
    save_figure(widths_figure(final, events, steps_per_epoch, last_step, title), path)


def widths_figure(final: dict[str, dict[str, int]], events: Sequence[Mapping[str, Any]], steps_per_epoch: int,
                  last_step: int, title: str) -> Any:
    """Per-layer heads and FFN channels against epochs (one panel per unit kind), titled `title`, the layers'
    legend beside each panel."""
    from matplotlib.ticker import MaxNLocator

    history = width_history(final, events)
    kinds = [k for k in UnitKind if k in history]
    fig, axes = pyplot().subplots(len(kinds), 1, figsize=(8, 3.2 * len(kinds)), squeeze=False, sharex=True)
    for ax, kind in zip(axes[:, 0], kinds):
        for group, series in history[kind].items():
            steps, widths = zip(*(series + [(last_step, series[-1][1])]))
            ax.plot([s / steps_per_epoch for s in steps], widths, drawstyle="steps-post", label=group)
        ax.set_ylabel(f"{kind.noun}s")
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        legend_beside(ax, "layer")
    axes[-1, 0].set_xlabel("epoch")
    axes[0, 0].set_title(title)
    return fig


def save_figure(fig: Any, path: Path) -> None:
    """`fig` as a PNG at `path`, written atomically, with the legends beside its axes; then closed."""
    _atomic(path, lambda f: fig.savefig(f, dpi=120, format="png", bbox_inches="tight"))
    pyplot().close(fig)


def _atomic(path: Path, write) -> None:
    """Write through `write(tmp_path)` and rename over `path`, so a crash never leaves a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)
