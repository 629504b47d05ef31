"""The paired statistics of `barter compare` and benchmarks/compress.py (sign test, Student's t, paired-t interval),
against scipy on hand-made numbers, and their table in compare.md."""
from pathlib import Path

import pytest

from barter.training.compare import Row, comparisons, markdown
from barter.training.loop import RunResult
from barter.training.paired import paired_difference, sign_test, t_cdf, t_quantile
from barter.training.presets import preset

stats = pytest.importorskip("scipy.stats")

ACCURACY = {"static": [0.712, 0.695, 0.741, 0.703, 0.731], "barter": [0.721, 0.690, 0.758, 0.744, 0.740],
            "rigl": [0.705, 0.699, 0.736, 0.698, 0.722]}


@pytest.mark.parametrize("n", range(0, 13))
def test_sign_test_equals_scipys_binomial_test(n):
    for positive in range(n + 1):
        differences = [0.5] * positive + [-0.25] * (n - positive) + [0.0, 0.0]  # zeros are dropped
        expected = stats.binomtest(positive, n, 0.5).pvalue if n else 1.0
        assert sign_test(differences) == pytest.approx(expected, rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("df", [1, 2, 3, 4, 5, 8, 11, 30, 101])
def test_t_distribution_equals_scipys(df):
    for t in (-7.5, -2.2, -0.3, 0.0, 0.9, 2.776, 12.0):
        assert t_cdf(t, df) == pytest.approx(stats.t.cdf(t, df), rel=1e-11, abs=1e-14)
    for p in (0.025, 0.5, 0.6, 0.9, 0.975, 0.995):
        assert t_quantile(p, df) == pytest.approx(stats.t.ppf(p, df), rel=1e-10, abs=1e-12)
    with pytest.raises(ValueError):
        t_quantile(1.0, df)


def test_paired_t_interval_and_p_equal_scipys_ttest_rel():
    ours, theirs = ACCURACY["barter"], ACCURACY["static"]
    d = paired_difference(dict(enumerate(ours)), dict(enumerate(theirs)))
    reference = stats.ttest_rel(ours, theirs)
    interval = reference.confidence_interval(0.95)
    assert d.seeds == (0, 1, 2, 3, 4) and d.differences == pytest.approx([a - b for a, b in zip(ours, theirs)])
    assert (d.low, d.high) == pytest.approx((interval.low, interval.high), rel=1e-10)
    assert d.t_p == pytest.approx(reference.pvalue, rel=1e-9)
    assert d.sign_p == pytest.approx(stats.binomtest(4, 5, 0.5).pvalue)
    # only the seeds both ran are paired; one seed gives no interval
    single = paired_difference({0: 0.7, 3: 0.8}, {0: 0.6, 1: 0.5})
    assert single.seeds == (0,) and single.low is None and single.t_p is None and single.sign_p == 1.0
    assert paired_difference({0: 0.7}, {1: 0.6}) is None


def test_compare_md_pairs_each_method_with_static_and_the_baselines():
    rows = [Row(method, 0.3, seed, RunResult(Path("runs") / method, 1, 10, acc, acc - 0.1, acc, 1, 1e9, 1.0, 0), None)
            for method, values in ACCURACY.items() for seed, acc in enumerate(values)]
    rows.append(Row("dense", 1.0, 0, RunResult(Path("runs/dense"), 1, 10, 0.8, 0.7, 0.8, 1, 1e9, 1.0, 0), None))
    assert comparisons({"dense", "static", "barter", "rigl"}) == [("barter", "static"), ("rigl", "static"),
                                                                  ("static", "rigl"), ("barter", "rigl")]
    table = markdown(rows, preset("mnist5k_quick"), None)
    line = next(x for x in table.splitlines() if x.startswith("| barter | static | 0.3 | 5 |"))
    d = paired_difference(dict(enumerate(ACCURACY["barter"])), dict(enumerate(ACCURACY["static"])))
    assert f"{d.mean * 100:+.2f} [{d.low * 100:+.2f}, {d.high * 100:+.2f}]" in line
    assert f"| {d.sign_p:.3g} | {d.t_p:.3g} |" in line
    assert "+0.90 -0.50 +1.70 +4.10 +0.90" in line  # the per-seed differences, percentage points
    assert sum(x.startswith("| ") and " | rigl | 0.3 |" in x for x in table.splitlines()) == 2
    assert not any(x.startswith("| dense | ") and "static" in x for x in table.splitlines())


def test_compare_md_never_pairs_runs_of_different_budgets():
    """A matched-compute run (113 steps) beside a 63-step reference is reported as budgets differing, never as
    a paired difference; seeds with equal budgets are still paired."""
    def row(method, seed, steps, acc):
        return Row(method, 0.3, seed, RunResult(Path("runs") / method, 1, steps, acc, acc, acc, 1, 1e9, 1.0, 0), None)
    rows = [row("barter", 0, 113, 0.9), row("static", 0, 63, 0.6), row("barter", 1, 63, 0.7), row("static", 1, 63, 0.6)]
    lines = [x for x in markdown(rows, preset("mnist5k_quick"), None).splitlines() if x.startswith("| barter | static")]
    assert any("budgets differ: 113 vs 63 steps" in x for x in lines)
    paired = [x for x in lines if "budgets differ" not in x]
    assert len(paired) == 1 and paired[0].startswith("| barter | static | 0.3 | 1 |") and "+10.00" in paired[0]
    assert "+30.00" not in "\n".join(lines)
