"""widths.png and compare.png: titled, labelled, their legends beside the data, a one-epoch curve a visible point
with its value."""
import json
from pathlib import Path

from PIL import Image

from barter.training.compare import Row, compare_figure, plot
from barter.training.loop import RunResult
from barter.training.runlog import plot_widths, widths_figure

FINAL = {"blocks.0.attn": {"head": 1}, "blocks.1.attn": {"head": 3},
         "blocks.0.mlp.fc1": {"channel": 12}, "blocks.1.mlp.fc1": {"channel": 8}}
EVENTS = [{"step": 3, "kind": "head", "donor_group": "blocks.0.attn", "receiver_group": "blocks.1.attn",
           "skipped": None},
          {"step": 5, "kind": "channel", "donor_group": "blocks.1.mlp.fc1", "receiver_group": "blocks.0.mlp.fc1",
           "skipped": None},
          {"step": 6, "kind": "head", "donor_group": "blocks.0.attn", "receiver_group": "blocks.1.attn",
           "skipped": "no donor"}]


def legend_right_of_axes(ax) -> bool:
    """Whether the legend of `ax` lies wholly to the right of its axes, as drawn."""
    renderer = ax.figure.canvas.get_renderer()
    return ax.get_legend().get_window_extent(renderer).x0 >= ax.get_window_extent(renderer).x1


def test_widths_figure_is_titled_labelled_with_its_legend_beside(tmp_path: Path) -> None:
    fig = widths_figure(FINAL, EVENTS, steps_per_epoch=4, last_step=8, title="run: units per layer")
    heads, channels = fig.axes
    assert heads.get_title() == "run: units per layer"
    assert (heads.get_ylabel(), channels.get_ylabel(), channels.get_xlabel()) == (
        "attention heads", "FFN channels", "epoch")
    assert [t.get_text() for t in heads.get_legend().get_texts()] == ["blocks.0.attn", "blocks.1.attn"]
    assert heads.get_legend().get_title().get_text() == "layer"
    assert legend_right_of_axes(heads) and legend_right_of_axes(channels)
    first = {line.get_label(): list(line.get_ydata()) for line in heads.get_lines()}
    assert first == {"blocks.0.attn": [2, 1, 1], "blocks.1.attn": [2, 3, 3]}  # the skipped transfer moved nothing
    plot_widths(tmp_path / "widths.png", FINAL, EVENTS, 4, 8, title="run")
    assert Image.open(tmp_path / "widths.png").width > 8 * 120  # the legend beside the axes is in the file


def _row(tmp_path: Path, method: str, seed: int, accs: list[float]) -> Row:
    run = tmp_path / f"{method}-{seed}"
    run.mkdir()
    records = [{"epoch": i + 1, "flops": 1e9 * (i + 1), "acc": acc} for i, acc in enumerate(accs)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    result = RunResult(run, len(accs), len(accs), accs[-1], accs[-1], accs[-1], len(accs), 1e9, 1.0, 0)
    return Row(method, 0.5, seed, result, None)


def test_compare_figure_shows_a_one_epoch_curve_as_a_labelled_point(tmp_path: Path) -> None:
    rows = [_row(tmp_path, "dense", 0, [0.25]), _row(tmp_path, "barter", 0, [0.5]), _row(tmp_path, "barter", 1, [0.7]),
            _row(tmp_path, "static", 0, [0.1, 0.3])]
    fig = compare_figure(rows)
    (ax,) = fig.axes
    assert ax.get_title() and ax.get_xlabel() and ax.get_ylabel() == "test accuracy"
    assert legend_right_of_axes(ax)
    assert sorted(t.get_text() for t in ax.texts) == ["0.250", "0.600"]  # the one-epoch points, mean of two seeds
    markers = {line.get_label(): line.get_markersize() for line in ax.get_lines()}
    assert markers["dense"] > markers["static ρ=0.5"]
    assert len(ax.collections) == 1  # barter's two seeds at one epoch: an error bar, not an invisible band
    plot(tmp_path / "compare.png", rows)
    assert Image.open(tmp_path / "compare.png").width > 7 * 120
