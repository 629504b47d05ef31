"""Schedule: K_H / K_C rounding, midpoints, interval ends and cooldown lengths against hand-computed tables."""
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from barter.schedule import make_schedule, rnd, transfer_count


def test_rnd_rounds_half_up():
    assert [rnd(x) for x in (0.5, 1.5, 2.5, 2.4999, -0.5)] == [1, 2, 3, 2, 0]


@pytest.mark.parametrize("budget,ratio,feasible,expected", [
    (34, 2 / 34, True, 2),        # the reference configuration
    (8, 2 / 34, True, 1),         # 0.47 rounds to 0, raised to the minimum of 1
    (51, 2 / 34, True, 3),        # exactly 3.0
    (25, 2 / 34, True, 1),       # 1.47 -> 1
    (26, 2 / 34, True, 2),        # 1.53 -> 2
    (1067, 60 / 1067, True, 60),
    (384, 60 / 1067, True, 22),   # 21.59 -> 22
    (4608, 60 / 1067, True, 259),  # 259.1 -> 259
    (384, 60 / 1067, False, 0),
])
def test_transfer_count(budget, ratio, feasible, expected):
    assert transfer_count(budget, ratio, feasible) == expected


def test_schedule_table_T400():
    # T=400: window 40..160 (120 steps). Heads K=1: Delta 120, midpoint 100. Channels K=22: Delta 5.4545.
    s = make_schedule(400, {"head": 1, "channel": 22})
    assert (s.t_start, s.t_end) == (40, 160)
    assert s.steps["head"] == [100]
    assert s.steps["channel"] == [45, 51, 56, 62, 67, 73, 78, 84, 89, 95, 100, 105, 111, 116, 122, 127, 133, 138,
                                  144, 149, 155, 160]
    assert s.cooldown == {"head": 120, "channel": 11}  # ceil(120), ceil(10.909)


def test_schedule_table_T120():
    # T=120: window 12..48. Heads K=2: Delta 18, midpoints 21, 39. Channels K=5: Delta 7.2 -> 19.2, 26.4, ...
    s = make_schedule(120, {"head": 2, "channel": 5})
    assert (s.t_start, s.t_end) == (12, 48)
    assert s.steps["head"] == [21, 39]
    assert s.steps["channel"] == [19, 26, 34, 41, 48]
    assert s.cooldown == {"head": 18, "channel": 15}  # ceil(18), ceil(14.4)


def test_schedule_table_T25_half_steps():
    # T=25: t_start = rnd(2.5) = 3 (half up), t_end = rnd(10) = 10. Heads K=3: Delta 7/3, midpoints
    # 4.1667, 6.5 -> 7 (half up), 8.8333 -> 9. Channels K=2: Delta 3.5 -> 6.5 -> 7, 10.
    s = make_schedule(25, {"head": 3, "channel": 2})
    assert (s.t_start, s.t_end) == (3, 10)
    assert s.steps["head"] == [4, 7, 9]
    assert s.steps["channel"] == [7, 10]
    assert s.cooldown == {"head": 3, "channel": 7}


def test_more_proposals_than_steps_share_steps():
    s = make_schedule(20, {"head": 0, "channel": 9})  # window 2..8, Delta 2/3
    assert s.steps["head"] == [] and s.cooldown["head"] == 0
    assert s.steps["channel"] == [3, 3, 4, 5, 5, 6, 7, 7, 8]
    assert s.last("channel") == 8 and s.last("head") == 0


@given(T=st.integers(1, 100_000), kh=st.integers(0, 50), kc=st.integers(0, 500))
def test_schedule_properties(T, kh, kc):
    s = make_schedule(T, {"head": kh, "channel": kc})
    assert len(s.steps["head"]) == kh and len(s.steps["channel"]) == kc
    for kind, k in (("head", kh), ("channel", kc)):
        steps = s.steps[kind]
        assert steps == sorted(steps)
        assert all(max(1, s.t_start) <= t <= max(1, s.t_end) for t in steps)
        if k:
            delta = (s.t_end - s.t_start) / k
            gap = 1 if kind == "head" else 2  # the cooldown spans one head / two channel intervals
            assert s.cooldown[kind] == math.ceil(gap * delta)
            # every proposal within the cooldown's reach of a transfer is excluded, whatever the rounding
            assert all(steps[i + gap] - steps[i] <= s.cooldown[kind] for i in range(len(steps) - gap))
    if kc:
        assert s.steps["channel"][-1] == max(1, s.t_end)
