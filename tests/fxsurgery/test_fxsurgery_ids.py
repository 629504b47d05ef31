"""Id pairs: what ties coordinates together. `pairs` drops slices that repeat along a dim before broadcasting; the
pairs it finds must be those of the broadcast tensors, position by position."""
from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from fxsurgery.dataflow.ids import NO_ID, broadcast, pairs, unique_pairs


def every_position(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The reference: the distinct (a, b) pairs at every position of the broadcast tensors where both hold an id."""
    a, b = broadcast(a, b)
    held = (a != NO_ID) & (b != NO_ID)
    return unique_pairs(torch.stack([a[held], b[held]], dim=1))


@st.composite
def id_tensors(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor]:
    """Two broadcastable id tensors (ranks 1-4, sizes 1-4, some dims broadcast in one of them, NO_ID among the ids,
    few distinct ids so that slices repeat)."""
    full = draw(st.lists(st.integers(1, 4), min_size=1, max_size=4))
    shapes = [[n if draw(st.booleans()) else 1 for n in full] for _ in range(2)]
    shapes[0] = shapes[0][draw(st.integers(0, len(full) - 1)):]  # a lower rank, aligned on the right
    high = draw(st.sampled_from([1, 2, 6]))
    made = [torch.tensor(draw(st.lists(st.integers(NO_ID, high), min_size=n, max_size=n)), dtype=torch.long)
            for n in (int(torch.Size(s).numel()) for s in shapes)]
    return made[0].reshape(shapes[0]), made[1].reshape(shapes[1])


@given(id_tensors())
def test_pairs_are_those_of_every_broadcast_position(operands: tuple[torch.Tensor, torch.Tensor]) -> None:
    a, b = operands
    assert torch.equal(pairs(a, b), every_position(a, b))


def test_a_stream_repeated_over_its_tokens_pairs_once_per_feature() -> None:
    stream = torch.arange(8).repeat(5, 1).unsqueeze(0)  # (1, tokens, features): the same ids at every token
    stream[0, 0] += 100  # a class token of its own
    weight = torch.arange(200, 208)
    found = pairs(weight, stream)
    assert found.shape == (16, 2) and torch.equal(found, every_position(weight, stream))
