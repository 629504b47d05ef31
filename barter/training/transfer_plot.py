"""transfers.png: what each transfer did to the probe loss, and to its units' next updates (`barter.transfer_probe`).

One row per run (or per group of runs pooled, as `barter compare` pools the seeds of a method and density):
left, the probe loss just after, 10 and 100 steps after each transfer, minus the loss just before it, against the
transfer's step (the jump, then the recovery; below zero: lower than before); right, the median over the transfers
of the relative update size ||Δw|| / ||w|| of the parent, its new twin and a kept unit of the same layer at each
step after the transfer (log scale).
"""
from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..transfer_event import DELAYS, ROLES
from ..transfer_probe import UPDATE_STEPS

LOSS_SERIES = (("probe_loss_after", "just after (jump)"),
               *((f"probe_loss_{d}", f"{d} steps after") for d in DELAYS))
ROLE_LABELS = {"parent": "parent", "new": "new unit (clone)", "kept": "kept unit, same layer"}


def probed(events: Sequence[Mapping[str, Any]]) -> Sequence[Mapping[str, Any]]:
    """The executed transfers whose probe loss was recorded (a skipped attempt has none)."""
    return [e for e in events if e.get("probe_loss_before") is not None]


def plot_transfers(path: Path, runs: dict[str, Sequence[Mapping[str, Any]]]) -> None:
    """Write transfers.png at `path` for `runs` ({label: events}); runs without a probed transfer are left out, and
    with none at all a figure says so (the file is always written)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = {label: probed(events) for label, events in runs.items() if probed(events)}
    if not rows:
        fig, ax = plt.subplots(figsize=(6, 2))
        ax.axis("off")
        ax.text(0.5, 0.5, "no transfer with a recorded probe loss", ha="center", va="center")
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return
    fig, axes = plt.subplots(len(rows), 2, figsize=(12, 3.6 * len(rows)), squeeze=False)
    for (label, events), (loss_ax, update_ax) in zip(rows.items(), axes):
        _loss_panel(loss_ax, label, events)
        _update_panel(update_ax, label, events)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _loss_panel(ax, label: str, events: Sequence[Mapping[str, Any]]) -> None:
    for key, name in LOSS_SERIES:
        points = [(e["step"], e[key] - e["probe_loss_before"]) for e in events if e.get(key) is not None]
        if points:
            ax.plot(*zip(*points), linestyle="none", marker="o", markersize=4, alpha=0.8, label=name)
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_title(f"{label}: probe loss around each transfer ({len(events)} transfers)", fontsize=9)
    ax.set_xlabel("training step of the transfer")
    ax.set_ylabel("probe loss − loss before")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")


def _update_panel(ax, label: str, events: Sequence[Mapping[str, Any]]) -> None:
    for role in ROLES:
        series = [e[f"update_{role}"] for e in events if e.get(f"update_{role}")]
        steps = range(1, UPDATE_STEPS + 1)
        medians = [(k, statistics.median(s[k - 1] for s in series if len(s) >= k)) for k in steps
                   if any(len(s) >= k for s in series)]
        if medians:
            ax.plot(*zip(*medians), marker="o", markersize=3, label=f"{ROLE_LABELS[role]} (n={len(series)})")
    ax.set_yscale("log")
    ax.set_title(f"{label}: relative update size after a transfer (median)", fontsize=9)
    ax.set_xlabel("optimizer steps after the transfer")
    ax.set_ylabel("‖Δw‖ / ‖w‖ per step")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="best")
