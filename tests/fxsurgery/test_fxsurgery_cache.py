"""The analysis caches are bounded: an `LruCache` keeps its `limit` most recently used entries and a hit returns the
very object stored; the helper-function traces and the tables hosts built alike share are such caches."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from zoo import Style, TinyTransformer

from fxsurgery import analyse
from fxsurgery.analysis.model import host_analysis
from fxsurgery.capture import tracer
from fxsurgery.lru import LruCache

# a step: ("put", key) stores a fresh object under key; ("get", key) reads it where it is kept
steps = st.lists(st.tuples(st.sampled_from(["put", "get"]), st.integers(0, 5)), max_size=40)


@given(limit=st.integers(1, 6), ops=steps)
def test_a_cache_keeps_its_most_recently_used_entries_and_a_hit_is_the_object_stored(limit: int, ops: list) -> None:
    cache: LruCache[int, object] = LruCache(limit)
    stored: dict[int, object] = {}
    recent: list[int] = []  # the reference: the keys kept, by last use, most recent last
    for op, key in ops:
        if op == "put":
            stored[key] = object()
            cache[key] = stored[key]
        elif key in recent:
            assert cache[key] is stored[key]
        else:
            assert key not in cache and cache.get(key) is None
            continue
        recent = ([k for k in recent if k != key] + [key])[-limit:]
        assert len(cache) <= limit and cache.keys() == recent


def test_a_cache_holds_one_entry_at_least() -> None:
    with pytest.raises(ValueError, match="one entry at least"):
        LruCache(0)


def scaled(x: torch.Tensor, factor: float) -> torch.Tensor:
    return x * factor


def shifted(x: torch.Tensor, shift: float) -> torch.Tensor:
    return x + shift


def test_helper_traces_are_reused_and_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same helper, frozen values and tensor shapes give the same traced graph module; past the limit the least
    recently used trace is forgotten, and tracing it again gives a graph that computes the same."""
    monkeypatch.setattr(tracer, "function_graphs", LruCache(2))
    x = torch.randn(3, 4)
    first, _ = tracer.trace_function(scaled, {"x": x, "factor": 2.0})
    again, _ = tracer.trace_function(scaled, {"x": torch.randn(3, 4), "factor": 2.0})
    assert again is first
    tracer.trace_function(scaled, {"x": x, "factor": 3.0})
    tracer.trace_function(shifted, {"x": x, "shift": 1.0})
    assert len(tracer.function_graphs) == 2
    retraced, values = tracer.trace_function(scaled, {"x": x, "factor": 2.0})
    assert retraced is not first
    assert torch.equal(retraced(*values), first(*values)) and torch.equal(first(*values), x * 2)


def test_hosts_built_alike_share_one_cached_analysis() -> None:
    """Every block of a model is built alike: each kind of host (attention, MLP) is analysed once, asking again for
    any block's host (of the model itself, not of the analysed copy) is a hit that returns that very analysis, and
    the table holds one entry per kind, within its bound."""
    model = TinyTransformer(Style(heads=3, depth=3))
    plan = analyse(model, (torch.randn(2, 4, 5),))._plan
    found = {host: host_analysis(model, host, plan.calls[host], plan.shared) for host in plan.hosts}
    kinds = {host.rpartition(".")[2] for host in found}
    assert len(found) == 3 * len(kinds) and len(plan.shared.templates) == len(kinds) <= plan.shared.templates.limit
    for host, analysis in found.items():
        assert analysis is found[f"blocks.0.{host.rpartition('.')[2]}"], host
