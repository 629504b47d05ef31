"""Paired comparisons of two methods run with the same seeds: the per-seed differences, an exact two-sided sign test
and a paired-t 95% interval (with the paired t-test's p), computed without scipy.

Student's t distribution at integer degrees of freedom has a closed-form CDF (Abramowitz and Stegun 26.7.3-4, a
finite series in cos^2 of atan(t / sqrt(df))); its quantile is found by bisection to machine precision.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction


def sign_test(differences: Sequence[float]) -> float:
    """Exact two-sided sign test: P(a split of the nonzero differences at least as uneven | each sign has
    probability 1/2). Zeros are dropped; with no nonzero difference the p-value is 1."""
    positive = sum(d > 0 for d in differences)
    n = positive + sum(d < 0 for d in differences)
    fewer = min(positive, n - positive)
    tail = sum(Fraction(math.comb(n, i), 2 ** n) for i in range(fewer + 1))
    return float(min(Fraction(1), 2 * tail))


def t_cdf(t: float, df: int) -> float:
    """P(T <= t) for Student's t with `df` (a positive integer) degrees of freedom."""
    if df < 1 or int(df) != df:
        raise ValueError(f"degrees of freedom must be a positive integer, got {df}")
    inside = _central(abs(t), int(df))
    return 0.5 + 0.5 * inside if t >= 0 else 0.5 - 0.5 * inside


def t_quantile(p: float, df: int) -> float:
    """The t with P(T <= t) = p, for 0 < p < 1 and `df` integer degrees of freedom."""
    if not 0 < p < 1:
        raise ValueError(f"p must be in (0, 1), got {p}")
    if p < 0.5:
        return -t_quantile(1 - p, df)
    target = 2 * p - 1  # P(|T| <= t)
    low, high = 0.0, 1.0
    while _central(high, df) < target:
        low, high = high, 2 * high
    for _ in range(200):
        middle = (low + high) / 2
        if middle in (low, high):
            break
        low, high = (middle, high) if _central(middle, df) < target else (low, middle)
    return (low + high) / 2


def _central(t: float, df: int) -> float:
    """P(|T| <= t) for t >= 0 (Abramowitz and Stegun 26.7.3 for odd df, 26.7.4 for even df)."""
    theta = math.atan(t / math.sqrt(df))
    cos2 = math.cos(theta) ** 2
    term = series = 1.0
    if df % 2:
        for k in range(1, (df - 3) // 2 + 1):
            term *= 2 * k / (2 * k + 1) * cos2
            series += term
        sine_cosine = math.sin(theta) * math.cos(theta) * series if df > 1 else 0.0
        return 2 / math.pi * (theta + sine_cosine)
    for k in range(1, (df - 2) // 2 + 1):
        term *= (2 * k - 1) / (2 * k) * cos2
        series += term
    return math.sin(theta) * series


@dataclass(frozen=True)
class PairedDifference:
    """method - reference over the seeds both were run with: per seed, their mean, the paired-t interval at
    `level` (None with one seed), the paired t-test's two-sided p (None with one seed or identical differences)
    and the sign test's p."""

    seeds: tuple[int, ...]
    differences: tuple[float, ...]
    mean: float
    low: float | None
    high: float | None
    t_p: float | None
    sign_p: float
    level: float = 0.95


def paired_difference(method: Mapping[int, float], reference: Mapping[int, float],
                      level: float = 0.95) -> PairedDifference | None:
    """The paired comparison of two {seed: value} results, or None when they share no seed."""
    seeds = tuple(sorted(set(method) & set(reference)))
    if not seeds:
        return None
    differences = tuple(method[s] - reference[s] for s in seeds)
    mean = statistics.fmean(differences)
    low = high = t_p = None
    if len(seeds) > 1:
        error = statistics.stdev(differences) / math.sqrt(len(seeds))
        half = t_quantile(0.5 + level / 2, len(seeds) - 1) * error
        low, high = mean - half, mean + half
        if error > 0:
            t_p = 1 - _central(abs(mean) / error, len(seeds) - 1)
    return PairedDifference(seeds, differences, mean, low, high, t_p, sign_test(differences), level)


def difference_cells(d: PairedDifference, scale: float = 100.0, digits: int = 2) -> list[str]:
    """Markdown cells: the per-seed differences, their mean [interval], the sign test's p and the t-test's p, the
    differences times `scale` (percentage points by default)."""
    def fmt(x: float) -> str:
        return f"{x * scale:+.{digits}f}"

    interval = "" if d.low is None else f" [{fmt(d.low)}, {fmt(d.high)}]"
    return [" ".join(fmt(x) for x in d.differences), fmt(d.mean) + interval, f"{d.sign_p:.3g}",
            "-" if d.t_p is None else f"{d.t_p:.3g}"]
