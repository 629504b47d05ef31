"""Transfer events of two runs that train the same model in different ways (several processes, sharded, one):
the same decisions, and the numbers measured on them (`barter.transfer_probe.MEASURED`: the scores a choice was
made on, the probe losses and update sizes) equal to the tolerance to which the runs' weights and scores are."""
import pytest

from barter.transfer_probe import MEASURED


def decisions(events: list[dict]) -> list[dict]:
    """Each event without its measured numbers: which units moved where, when, or why none did."""
    return [{k: v for k, v in e.items() if k not in MEASURED} for e in events]


def assert_same_events(a: list[dict], b: list[dict], rel: float = 1e-4, abs: float = 1e-9) -> None:
    assert decisions(a) == decisions(b)
    for x, y in zip(a, b):
        for key in MEASURED:
            assert (x.get(key) is None) == (y.get(key) is None), (key, x, y)
            if x.get(key) is not None:
                assert x[key] == pytest.approx(y[key], rel=rel, abs=abs), (key, x, y)
