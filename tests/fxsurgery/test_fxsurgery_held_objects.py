"""A module that returns an object pytree does not know, holding tensors (as a decoder returns its key/value cache):
the capture registers its type for the capture only, the installed graph returns the object as the module did, and
the heads are found; removing one equals zeroing its output-projection columns and equals zeroing it at its tap."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from test_fxsurgery_encoder_decoder import tiny_t5

from fxsurgery import Surgeon
from fxsurgery.capture.front_ends import FrontEnd
from fxsurgery.compat import is_pytree_node

HEADS, HEAD_DIM, DIM = 3, 4, 8


class Summary:
    """What the block hands on beside its output: a tensor at the model's width, a step count and a name."""

    def __init__(self, state: torch.Tensor, steps: int):
        self.state, self.steps, self.name = state, steps, "summary"


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(DIM, 3 * HEADS * HEAD_DIM), nn.Linear(HEADS * HEAD_DIM, DIM)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, Summary]:
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, HEADS, HEAD_DIM).permute(2, 0, 3, 1, 4)
        y = self.out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, -1))
        return y, Summary(y.mean(1), steps=n)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.attn, self.head = nn.Linear(3, DIM), Attention(), nn.Linear(DIM, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, Summary]:
        h = self.embed(x)
        y, summary = self.attn(h)
        return self.head(h + y), summary


def outputs(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        y, summary = model(x)
    assert isinstance(summary, Summary) and (summary.steps, summary.name) == (x.shape[1], "summary")
    return y, summary.state


def test_heads_found_where_the_module_returns_an_object_holding_tensors() -> None:
    torch.manual_seed(0)
    model, x = Model().double(), torch.randn(2, 5, 3, dtype=torch.double)
    zeroed, reference = copy.deepcopy(model), outputs(model, x)
    s = Surgeon(model, (x,))
    assert not is_pytree_node(Summary)  # registered for the capture only
    assert FrontEnd.CONCRETE in {use.front_end for use in s._front_ends.values()}
    (heads,) = [g for g in s.groups if g.kind == "head"]
    assert (heads.count, heads.exact) == (HEADS, True)
    assert all(torch.allclose(a, b, atol=1e-12) for a, b in zip(outputs(model, x), reference))

    handle = s.tap(heads, lambda a: a.select(-2, 1).zero_())
    tapped = outputs(model, x)
    handle.remove()
    with torch.no_grad():
        zeroed.attn.out.weight[:, HEAD_DIM:2 * HEAD_DIM] = 0
        s.remove(heads, 1)
    removed = outputs(model, x)
    assert model.attn.out.weight.shape == (DIM, (HEADS - 1) * HEAD_DIM)
    for a, b, c in zip(removed, outputs(zeroed, x), tapped):
        assert torch.allclose(a, b, atol=1e-12) and torch.allclose(a, c, atol=1e-12)


def test_t5_decoder_self_attention_heads_behind_its_returned_cache() -> None:
    """The decoder returns an ``EncoderDecoderCache``, which the capture registers as a pytree node for itself only:
    its self-attention heads are found (exact under both oracles and cached decoding:
    ``test_fxsurgery_encoder_decoder.py``)."""
    model = tiny_t5()
    ids = torch.randint(0, 64, (2, 8))
    s = Surgeon(model, (), {"input_ids": ids, "labels": ids})
    cache_utils = pytest.importorskip("transformers.cache_utils")
    assert not any(is_pytree_node(cls) for cls in (cache_utils.EncoderDecoderCache, cache_utils.DynamicCache,
                                                   cache_utils.DynamicLayer))  # registered for the captures only
    with torch.no_grad():
        assert isinstance(model(input_ids=ids, labels=ids).past_key_values, cache_utils.EncoderDecoderCache)
    assert (s.group("decoder.block:head").count, s.group("decoder.block:head").exact) == (4, True)
