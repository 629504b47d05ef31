"""fxsurgery on channels-first transformers: pointwise convolutions as projections, BatchNorm on
their outputs, a depthwise convolution between the FFN's fc1 and fc2."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from hypothesis import given
from hypothesis import strategies as st
from test_fxsurgery_properties import assert_masked_then_clones_exact, layer_groups, remove_random_unit
from zoo import ConvTransformer, masked_copy

from fxsurgery import Surgeon

shapes = st.fixed_dictionaries({"heads": st.integers(2, 4), "head_dim": st.integers(2, 4),
                                "hidden": st.integers(2, 6), "depth": st.integers(1, 2)})


def build(kw: dict, seed: int = 0) -> tuple[ConvTransformer, torch.Tensor]:
    torch.manual_seed(seed)
    model = ConvTransformer(**kw).double()
    with torch.no_grad():  # non-trivial BatchNorm statistics, so eval mode uses them
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.normal_()
                m.running_var.uniform_(0.5, 2)
    return model, torch.randn(2, 3, 8, 8, dtype=torch.double)


@given(kw=shapes, data=st.data())
def test_groups_clone_and_remove(kw: dict, data: st.DataObject) -> None:
    model, x = build(kw)
    original = copy.deepcopy(model).eval()
    s = Surgeon(model, (x,))
    groups = layer_groups(s)
    assert sorted(groups) == sorted([n for n, _ in model.HEAD_OUT] + model.FFN_OUT)
    assert all(g.exact for g in s.groups)
    for name, _ in model.HEAD_OUT:
        assert groups[name].kind == "head" and groups[name].count == kw["heads"]
    for name in model.FFN_OUT:
        assert groups[name].kind == "channel" and groups[name].count == kw["hidden"]
    model.eval()
    width = {name: (kw["head_dim"] if g.kind == "head" else 1) for name, g in groups.items()}
    alive = {name: list(range(g.count)) for name, g in groups.items()}
    for _ in range(data.draw(st.integers(1, 5))):
        remove_random_unit(s, groups, alive, data)
    assert_masked_then_clones_exact(s, original, x, groups, alive, width, data)


def test_train_mode_matches_and_taps_see_channels_first_units() -> None:
    kw = {"heads": 3, "head_dim": 2, "hidden": 4, "depth": 1}
    model, x = build(kw)
    original = copy.deepcopy(model)
    s = Surgeon(model, (x,))
    with torch.no_grad():
        assert torch.equal(model.train()(x), original.train()(x))  # BatchNorm on batch statistics
    seen = {}
    for g in s.groups:
        s.tap(g, lambda a, g=g: seen.setdefault(g.name, a))
    model(x).sum().backward()
    shapes = {g.kind: tuple(seen[g.name].shape) for g in s.groups}
    assert shapes == {"head": (2, 4, 4, 3, 2), "channel": (2, 4, 4, 4, 1)}
    assert all(p.grad is not None for p in model.parameters())


class SplitPositionAttention(torch.nn.Module):
    """Heads split into two parts, each with a depthwise convolution of its own over v (as CoaT's
    convolutional relative position encoding): no single layer of heads exists."""

    def __init__(self, dim: int = 8, heads: int = 4, head_dim: int = 2, split: tuple[int, int] = (1, 3)):
        super().__init__()
        self.h, self.hd, self.split = heads, head_dim, [n * head_dim for n in split]
        self.qkv = torch.nn.Linear(dim, 3 * heads * head_dim)
        self.convs = torch.nn.ModuleList(torch.nn.Conv1d(c, c, k, padding=k // 2, groups=c)
                                         for c, k in zip(self.split, (3, 5)))
        self.proj = torch.nn.Linear(heads * head_dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, self.h, self.hd).permute(2, 0, 3, 1, 4).unbind(0)
        attn = (q @ k.transpose(-2, -1) * self.hd ** -0.5).softmax(-1) @ v
        parts = v.transpose(-1, -2).reshape(B, self.h * self.hd, N).split(self.split, dim=1)
        pos = torch.cat([self.convs[0](parts[0]), self.convs[1](parts[1])], 1).reshape(B, self.h, self.hd, N)
        return self.proj((attn + q * pos.transpose(-1, -2)).transpose(1, 2).reshape(B, N, -1))


class SplitPositionBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = SplitPositionAttention()
        self.mlp = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.GELU(), torch.nn.Linear(6, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x)
        return x + self.mlp(x)


def test_heads_split_across_parameters_are_refused_at_their_attention_module() -> None:
    torch.manual_seed(0)
    model = SplitPositionBlock().double()
    x = torch.randn(2, 6, 8, dtype=torch.double)
    original = copy.deepcopy(model)
    s = Surgeon(model, (x,))
    assert [g.name for g in s.groups] == ["mlp:channel"]
    refused = [lo for lo in s.left_out if lo.module == "attn"]
    assert refused and "convs.0.weight: holds units 0 of 4 only" in refused[0].reasons[0]
    assert "attn: convs.0.weight: holds units 0 of 4 only" in s.explain()
    with torch.no_grad():
        assert torch.equal(model(x), original(x))


class PooledMlp(torch.nn.Module):
    """fc1 as a pointwise convolution, a max pool and an average pool over space, fc2: pooling keeps the
    hidden channels apart, so they are one exact group."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Conv2d(3, 6, 1), torch.nn.Conv2d(6, 4, 1)
        self.pool = torch.nn.MaxPool2d(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.avg_pool2d(self.pool(torch.relu(self.fc1(x))), 2)
        return self.fc2(h).flatten(1)


def test_pooling_keeps_channels_apart() -> None:
    torch.manual_seed(0)
    model = PooledMlp().double()
    original = copy.deepcopy(model)
    x = torch.randn(2, 3, 8, 8, dtype=torch.double)
    s = Surgeon(model, (x,))
    g = s.group("PooledMlp:channel")
    assert g.count == 6 and g.exact and not s.left_out
    with torch.no_grad():
        s.remove(g, 2)
        assert (model(x) - masked_copy(original, {"fc2.weight": {2}}, {"fc2.weight": 1})(x)).abs().max().item() <= 1e-9


class ShapeBranchNormedFFN(nn.Module):
    """A 1x1-convolution FFN behind a normalisation, under a shape branch (the concrete-shape capture serves)."""

    def __init__(self, norm: nn.Module, dim: int = 8, hidden: int = 6):
        super().__init__()
        self.norm, self.fc1, self.fc2 = norm, nn.Conv2d(dim, hidden, 1), nn.Conv2d(hidden, dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] > 2:
            x = x + self.fc2(nn.functional.gelu(self.fc1(self.norm(x))))
        return x


@pytest.mark.parametrize("norm", [nn.GroupNorm(2, 8), nn.LayerNorm([8, 4, 4])], ids=["group_norm", "layer_norm"])
def test_captured_norms_replay_and_their_ffn_is_exact(norm: nn.Module) -> None:
    """ATen's group_norm and layer_norm carry a cudnn flag their torch functions do not take."""
    torch.manual_seed(0)
    model = nn.Sequential(ShapeBranchNormedFFN(norm), ShapeBranchNormedFFN(copy.deepcopy(norm))).double()
    x = torch.randn(2, 8, 4, 4, dtype=torch.double)
    masked = copy.deepcopy(model)
    s = Surgeon(model, (x,))
    assert [(g.module, g.count, g.exact) for g in s.groups] == [("0", 6, True), ("1", 6, True)]
    assert "torch.export" in s.explain()
    with torch.no_grad():
        s.remove(s.groups[1], 2)
        masked[1].fc2.weight[:, 2] = 0
        assert (model(x) - masked(x)).abs().max() <= 1e-9
