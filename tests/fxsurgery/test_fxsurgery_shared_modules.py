"""A module that several layers call (one per-head position convolution for a stage's blocks, as CoaT's): its
tensors are one for all of them, so a head owning channels of it is a unit of every layer that calls it. Where the
layers are hosts of their own, no host's graph sees the other calls: its heads are not offered (removing one would
resize the module under the other blocks), and each says why. Where one host holds every call (an output projection
two layers call), the heads of the layers are one group, as the weights say."""
from __future__ import annotations

import copy
import random

import torch
import torch.nn as nn
import torch.nn.functional as F

from fxsurgery import Surgeon, analyse
from tests.zoo import assert_removal_masks_and_clone_keeps, masked_copy, masked_outputs

HIDDEN, HEADS, HEAD_DIM, FFN, TOKENS = 16, 4, 4, 24, 5


class Attention(nn.Module):
    """Attention plus a depthwise convolution of its values over the tokens (``position``, possibly shared)."""

    def __init__(self, position: nn.Conv1d | None = None):
        super().__init__()
        self.qkv, self.proj = nn.Linear(HIDDEN, 3 * HIDDEN), nn.Linear(HIDDEN, HIDDEN)
        self.position = position

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, HEADS, c // HEADS).permute(2, 0, 3, 1, 4).unbind(0)
        out = F.scaled_dot_product_attention(q, k, v)
        if self.position is not None:
            out = out + self.position(v.transpose(-1, -2).reshape(b, c, n)).reshape(b, HEADS, -1, n).transpose(-1, -2)
        return self.proj(out.transpose(1, 2).reshape(b, n, c))


class Block(nn.Module):
    def __init__(self, position: nn.Conv1d | None = None):
        super().__init__()
        self.attn = Attention(position)
        self.fc1, self.fc2 = nn.Linear(HIDDEN, FFN), nn.Linear(FFN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x)
        return x + self.fc2(F.gelu(self.fc1(x)))


class OnInput(Attention):
    """The position term made from the block's input (the stream) rather than its values."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, HEADS, c // HEADS).permute(2, 0, 3, 1, 4).unbind(0)
        out = F.scaled_dot_product_attention(q, k, v)
        out = out + self.position(x.transpose(1, 2)).reshape(b, HEADS, -1, n).transpose(-1, -2)
        return self.proj(out.transpose(1, 2).reshape(b, n, c))


class Stage(nn.Module):
    """Two blocks calling one position convolution."""

    def __init__(self):
        super().__init__()
        position = nn.Conv1d(HIDDEN, HIDDEN, 3, padding=1, groups=HIDDEN)
        self.blocks = nn.ModuleList(Block(position) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _seeded() -> int:
    seed = random.randrange(2 ** 31)
    print(f"seed {seed}")
    torch.manual_seed(seed)
    return seed


def test_heads_owning_a_module_that_blocks_hosted_apart_call_are_not_offered() -> None:
    """Block 1 calls the convolution on its input, which ties the heads of block 0 to the stream: the model's pass
    refuses them, and each block is a host of its own whose graph sees only its own call."""
    _seeded()
    model = Stage().double().eval()
    model.blocks[1].attn.__class__ = OnInput
    before = copy.deepcopy(model)
    x = torch.randn(2, TOKENS, HIDDEN, dtype=torch.double)
    found = analyse(model, (x,))
    assert sorted(g.name for g in found.groups) == ["blocks.0:channel", "blocks.1:channel"]
    why = {}
    for lo in found.left_out:
        why.setdefault(lo.module, []).extend(lo.reasons)
    assert any("used by blocks.1.attn.position outside blocks.0: a tensor shared by layers cannot be sliced" in r
               for r in why["blocks.0.attn"]), why
    s = Surgeon(model, found)
    s.remove(s.group("blocks.0:channel"), 0)  # the channels still edit; both blocks still run the shared module
    reference = copy.deepcopy(before)
    with torch.no_grad():
        reference.blocks[0].fc2.weight[:, 0] = 0
        assert (model(x) - reference(x)).abs().max() < 1e-10
    assert model.blocks[1].attn.position.weight.shape[0] == HIDDEN


def test_heads_of_layers_that_call_one_output_projection_in_one_host_are_one_group() -> None:
    seed = _seeded()
    model = nn.Sequential(Block(), Block()).double().eval()
    model[1].attn.proj = model[0].attn.proj
    x = torch.randn(2, TOKENS, HIDDEN, dtype=torch.double)
    head = random.Random(seed).randrange(HEADS)
    reference, by_weights = masked_outputs(model, x, "0.attn.proj.weight", head, HEAD_DIM)
    s = Surgeon(model, (x,))
    heads = [g for g in s.groups if g.kind == "head"]
    assert [(g.name, g.count, g.exact) for g in heads] == [("Sequential:head", HEADS, True)], s.explain()
    assert {"0.attn.qkv.weight", "1.attn.qkv.weight", "0.attn.proj.weight"} <= {sl.name for sl in heads[0].slices}
    assert_removal_masks_and_clone_keeps(s, heads[0], head, lambda: model(x), by_weights=by_weights,
                                         reference=reference)
    assert model[0].attn.qkv.weight.shape[0] == model[1].attn.qkv.weight.shape[0] == 3 * HIDDEN


def test_heads_of_blocks_that_call_one_position_convolution_are_one_group_spanning_them() -> None:
    """Each block's projection reads the attention's output plus the shared convolution of its values: a sum of
    values one projection made, within the block, not a stream. Head h of both blocks is one unit (it owns channels
    of the one convolution), found by the model's pass: removing it equals zeroing its columns of both output
    projections, and zeroing it at the tap; a clone keeps the outputs."""
    seed = _seeded()
    model = Stage().double().eval()
    x = torch.randn(2, TOKENS, HIDDEN, dtype=torch.double)
    head = random.Random(seed).randrange(HEADS)
    projections = ["blocks.0.attn.proj.weight", "blocks.1.attn.proj.weight"]
    with torch.no_grad():
        reference = model(x)
        by_weights = masked_copy(model, dict.fromkeys(projections, {head}), dict.fromkeys(projections, HEAD_DIM))(x)
    s = Surgeon(model, (x,))
    heads = [g for g in s.groups if g.kind == "head"]
    assert [(g.name, g.count, g.exact) for g in heads] == [("blocks:head", HEADS, True)], s.explain()
    assert {"blocks.0.attn.qkv.weight", "blocks.1.attn.qkv.weight", "blocks.0.attn.position.weight",
            *projections} <= {sl.name for sl in heads[0].slices}
    assert_removal_masks_and_clone_keeps(s, heads[0], head, lambda: model(x), by_weights=by_weights,
                                         reference=reference)
    assert model.blocks[0].attn.position is model.blocks[1].attn.position
    assert model.blocks[1].attn.position.weight.shape[0] == model.blocks[1].attn.qkv.weight.shape[0] // 3 == HIDDEN


def test_barter_trains_a_model_whose_blocks_share_a_module_moving_only_its_channels() -> None:
    """Through `barter.wrap`, as a user trains: the heads left out stay whole in both blocks while the channels
    are made compact and transfer on the scores the taps read."""
    import barter

    _seeded()
    model = Stage()
    model.blocks[1].attn.__class__ = OnInput
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(4, TOKENS, HIDDEN)
    ctl = barter.wrap(model, optimizer, total_steps=12, density=0.5, example_inputs=(x,), window=(0.0, 0.8))
    assert sorted(g.name for g in ctl.surgeon.groups) == ["blocks.0:channel", "blocks.1:channel"]
    for _ in range(12):
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    assert ctl.tables["channel"].ema.abs().sum() > 0 and ctl.edits > 0
    assert all(block.attn.qkv.weight.shape[0] == 3 * HIDDEN for block in model.blocks)
    assert model.blocks[0].attn.position is model.blocks[1].attn.position
    assert model.blocks[0].attn.position.weight.shape[0] == HIDDEN


def test_barter_trains_the_heads_of_blocks_that_share_a_module_as_one_group() -> None:
    """Through `barter.wrap`: the heads of both blocks start compact as one group and the shared convolution keeps
    the channels of the heads kept; a head group alone has no other layer to trade with, so the heads stay at that
    width while the channels transfer on the scores the taps read."""
    import barter

    _seeded()
    model = Stage()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(4, TOKENS, HIDDEN)
    ctl = barter.wrap(model, optimizer, total_steps=12, density=0.5, example_inputs=(x,), window=(0.0, 0.8))
    assert sorted(g.name for g in ctl.surgeon.groups) == ["blocks.0:channel", "blocks.1:channel", "blocks:head"]
    for _ in range(12):
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    assert ctl.tables["channel"].ema.abs().sum() > 0 and ctl.edits > 0
    kept = ctl.surgeon.group("blocks:head").count
    assert kept == HEADS // 2
    for block in model.blocks:
        assert block.attn.qkv.weight.shape[0] == 3 * kept * HEAD_DIM
        assert block.attn.proj.weight.shape[1] == kept * HEAD_DIM
    assert model.blocks[0].attn.position.weight.shape[0] == kept * HEAD_DIM
    assert torch.isfinite(model(x)).all()
