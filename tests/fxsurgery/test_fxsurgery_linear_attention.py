"""Heads of linear (factorised) attention, ``q @ (softmax(k)ᵀ @ v)``: the keys' weights are applied to the values
before the queries contract them, so what the queries' product makes is values, not logits, and the output
projection that reads it (hidden × hidden, like a heads×heads map when the hidden width is the head count) is the
heads' sink. Each layer's heads are a group: a removal equals zeroing the head's projection columns and equals zeroing
it at the tap; a clone keeps the outputs; a layer keeps working at one head and at none."""
from __future__ import annotations

import copy
import random

import pytest
import torch
import torch.nn as nn

from fxsurgery import Surgeon
from tests.zoo import assert_removal_masks_and_clone_keeps, masked_copy, masked_outputs

HIDDEN, HEADS, HEAD_DIM, TOKENS = 16, 4, 4, 9


class LinearAttention(nn.Module):
    """Efficient attention: keys softmaxed over the positions make a context per head, which the queries (softmaxed
    over their channels) read. ``position_term``: a depthwise convolution of the values over the positions, multiplied
    by the queries and added, as CoaT adds its convolutional relative-position term."""

    def __init__(self, *, position_term: bool):
        super().__init__()
        self.qkv, self.proj = nn.Linear(HIDDEN, 3 * HIDDEN), nn.Linear(HIDDEN, HIDDEN)
        self.conv = nn.Conv1d(HIDDEN, HIDDEN, 3, padding=1, groups=HIDDEN) if position_term else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, HEADS, c // HEADS).permute(2, 0, 3, 1, 4).unbind(0)
        context = k.softmax(dim=2).transpose(-1, -2) @ v
        out = q.softmax(dim=-1) @ context
        if self.conv is not None:
            out = out + q * self.conv(v.transpose(-1, -2).reshape(b, c, n)).reshape(b, HEADS, -1, n).transpose(-1, -2)
        return self.proj(out.transpose(1, 2).reshape(b, n, c))


class LinearAttentionModel(nn.Module):
    def __init__(self, *, position_term: bool):
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(HIDDEN) for _ in range(2))
        self.attns = nn.ModuleList(LinearAttention(position_term=position_term) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for norm, attn in zip(self.norms, self.attns):
            x = x + attn(norm(x))
        return x


@pytest.mark.parametrize("position_term", [False, True])
def test_linear_attention_heads_are_a_group_per_layer(position_term: bool) -> None:
    seed = random.randrange(2 ** 31)
    print(f"seed {seed}")
    torch.manual_seed(seed)
    model = LinearAttentionModel(position_term=position_term).double().eval()
    model_before = copy.deepcopy(model)
    x = torch.randn(2, TOKENS, HIDDEN, dtype=torch.double)
    head = random.Random(seed).randrange(HEADS)
    reference, by_weights = masked_outputs(model, x, "attns.1.proj.weight", head, HEAD_DIM)
    s = Surgeon(model, (x,))
    groups = sorted((g.name, g.count, g.exact) for g in s.groups if g.kind == "head")
    assert groups == [(f"attns.{i}:head", HEADS, True) for i in range(2)], s.explain()
    heads = s.group("attns.1:head")
    if position_term:
        assert {"attns.1.conv.weight", "attns.1.conv.bias"} <= {sl.name for sl in heads.slices}
    assert_removal_masks_and_clone_keeps(s, heads, head, lambda: model(x), by_weights=by_weights,
                                         reference=reference)
    s.keep(s.group("attns.0:head"), [0])  # one head left
    first = 0 if head else 1  # the kept head the clone copied: its two halves make it whole again
    if position_term:  # a depthwise convolution of no channels cannot run: the layer keeps that head
        with pytest.raises(ValueError, match="a convolution cannot have zero channels"):
            s.keep(heads, [])
        s.keep(heads, [0, HEADS - 1])
    else:  # no head left: the layer adds its projection's bias alone
        s.keep(heads, [])
    dead = {"attns.0.proj.weight": set(range(1, HEADS)),
            "attns.1.proj.weight": set(range(HEADS)) - ({first} if position_term else set())}
    only = masked_copy(model_before, dead, width=dict.fromkeys(dead, HEAD_DIM))
    with torch.no_grad():
        assert (model(x) - only(x)).abs().max() < 1e-10
    assert model.attns[0].proj.weight.shape[1] == HEAD_DIM
    assert model.attns[1].proj.weight.shape[1] == (2 * HEAD_DIM if position_term else 0)


def test_coat_heads_are_reported_with_why_no_slice_removes_one() -> None:
    """CoaT's factor attention is linear attention with a convolutional relative-position term whose depthwise
    convolutions hold 2, 3 and 3 of its 8 heads, one per kernel size: no slice of one layer's heads edits them. Where a
    stage has several blocks they call one such module, which ties the heads of the blocks together: they meet the
    same convolutions as one set."""
    timm = pytest.importorskip("timm")
    model = timm.create_model("coat_tiny", img_size=32, serial_depths=[2, 1, 1, 1], parallel_depth=0,
                              embed_dims=[16, 16, 16, 16], mlp_ratios=[2, 2, 2, 2], num_heads=8).eval()
    from fxsurgery import analyse

    found = analyse(model, (torch.randn(1, 3, 32, 32),))
    assert not [g.name for g in found.groups if g.kind == "head"]
    why = {lo.module: " ".join(lo.reasons) for lo in found.left_out}
    # stage 1's two blocks call one module: their heads are one unit set spanning them, stopped where stages of
    # one block are, at the kernel sizes' convolutions
    assert "crpe1.conv_list.0.weight: holds units 0-1 of 8 only" in why["serial_blocks1"]
    for stage in (2, 3, 4):
        reason = why[f"serial_blocks{stage}.0.factoratt_crpe"]
        assert f"crpe{stage}.conv_list.0.weight: holds units 0-1 of 8 only" in reason
    assert {f"serial_blocks{stage}.0.mlp:channel" for stage in (2, 3, 4)} <= {g.name for g in found.groups}
