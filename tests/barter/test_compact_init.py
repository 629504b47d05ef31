"""Compact initialisation: initial counts and which units are kept."""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import barter
from barter.compact_init import initial_count, kept_units


@pytest.mark.parametrize("max_count,density,expected", [
    (3, 0.5, 2), (768, 0.5, 384), (12, 0.3, 4), (12, 0.1, 1), (3, 0.1, 1), (192, 0.1, 19), (5, 0.5, 3), (4, 1.0, 4),
])
def test_initial_count(max_count, density, expected):
    assert initial_count(max_count, density) == expected


@given(count=st.integers(1, 40), frac=st.floats(0, 1), seed=st.integers(0, 99),
       norms=st.lists(st.integers(0, 5), min_size=40, max_size=40))
def test_kept_units(count, frac, seed, norms):
    keep = max(1, round(frac * count))
    norm = torch.tensor(norms[:count], dtype=torch.float32)
    first = kept_units(count, keep, "first", torch.Generator(), lambda: norm)
    assert first == list(range(keep))
    rand = kept_units(count, keep, "random", torch.Generator().manual_seed(seed), lambda: norm)
    assert rand == sorted(set(rand)) and len(rand) == keep and all(0 <= i < count for i in rand)
    assert rand == kept_units(count, keep, "random", torch.Generator().manual_seed(seed), lambda: norm)
    mag = kept_units(count, keep, "magnitude", torch.Generator(), lambda: norm)
    dropped = [i for i in range(count) if i not in mag]
    assert len(mag) == keep and all(norm[k] >= norm[d] for k in mag for d in dropped)
    # ties go to the lower index
    assert all(not (norm[k] == norm[d] and d < k) for k in mag for d in dropped)


def test_example_inputs_required_outside_timm():
    with pytest.raises(ValueError, match="example_inputs"):
        barter.wrap(nn.Sequential(nn.Linear(4, 4)), total_steps=10)


def test_unknown_init_is_refused():
    with pytest.raises(ValueError, match="init"):
        barter.wrap(nn.Sequential(nn.Linear(4, 4)), total_steps=10, init="largest")
