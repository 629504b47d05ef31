"""What the run's and the study's figures (widths.png, compare.png) share: an off-screen pyplot and a legend
beside the data rather than over it (`barter.training.runlog.save_figure` writes them)."""
from __future__ import annotations

from typing import Any


def pyplot() -> Any:
    """matplotlib.pyplot drawing off-screen (Agg), imported only when a figure is made."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def legend_beside(ax: Any, title: str) -> None:
    """The legend of `ax` to the right of its axes, one entry per line (two columns past 16), never over the data."""
    entries = len(ax.get_legend_handles_labels()[1])
    ax.legend(title=title, fontsize=8, title_fontsize=8, ncol=1 if entries <= 16 else 2, loc="upper left",
              bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0, frameon=False)
