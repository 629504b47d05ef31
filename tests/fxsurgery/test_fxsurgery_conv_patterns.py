"""Convolutions over unit channels: an FFN whose layers are convolutions with a spatial kernel (a convolutional
FFN, a conv projection between stages), and a depthwise convolution with a channel multiplier between them (PiT's
pooling). Traced symbolically and captured (a forward branching on a size). References come from the model's own
layout: a channel is masked by zeroing it in the forward, or its weight slices on a copy."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from zoo import train_steps

from fxsurgery import Surgeon

DIM, HIDDEN, SIDE = 4, 5, 3


class ConvFeedForward(nn.Module):
    """Tokens on a SIDE×SIDE grid; ``fc1`` and ``fc2`` are 3×3 convolutions (``kernel``) or pointwise, with a
    depthwise convolution of channel ``multiplier`` between them. ``captured``: the forward branches on a size,
    which the symbolic tracer cannot follow."""

    def __init__(self, kernel: int, multiplier: int, captured: bool):
        super().__init__()
        self.captured = captured
        self.fc1 = nn.Conv2d(DIM, HIDDEN, kernel, padding=kernel // 2)
        self.dw = nn.Conv2d(HIDDEN, HIDDEN * multiplier, 3, padding=1, groups=HIDDEN)
        self.fc2 = nn.Conv2d(HIDDEN * multiplier, DIM, kernel, padding=kernel // 2)
        self.multiplier = multiplier

    def forward(self, x: torch.Tensor, zero: int | None = None) -> torch.Tensor:
        b, n, c = x.shape
        if self.captured and n <= 1:
            return x
        grid = x.transpose(1, 2).reshape(b, c, SIDE, SIDE)
        h = torch.relu(self.fc1(grid))
        h = torch.nn.functional.gelu(self.dw(h))
        if zero is not None:  # channel `zero` enters fc2 through its `multiplier` depthwise outputs
            h = h.clone()
            h[:, zero * self.multiplier:(zero + 1) * self.multiplier] = 0
        return x + self.fc2(h).flatten(2).transpose(1, 2)


def build(kernel: int, multiplier: int, captured: bool) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(ConvFeedForward(kernel, multiplier, captured), nn.LayerNorm(DIM), nn.Linear(DIM, 3)).double()


def inputs() -> torch.Tensor:
    return torch.randn(2, SIDE * SIDE, DIM, dtype=torch.double)


def masked(model: nn.Sequential, x: torch.Tensor, zero: int) -> torch.Tensor:
    return model[2](model[1](model[0](x, zero)))


CASES = [(3, 1), (3, 2), (1, 2)]


@pytest.mark.parametrize("captured", [False, True], ids=["traced", "captured"])
@pytest.mark.parametrize(("kernel", "multiplier"), CASES)
def test_conv_channels_clone_unchanged_and_removal_equals_masking(kernel: int, multiplier: int,
                                                                  captured: bool) -> None:
    model, x = build(kernel, multiplier, captured), inputs()
    original = copy.deepcopy(model)
    s = Surgeon(model, (x,))
    (g,) = s.groups
    assert (g.kind, g.count, g.exact) == ("channel", HIDDEN, True), s.explain()
    with torch.no_grad():
        y0 = original(x)
        for mode in ("train", "eval"):
            getattr(model, mode)()
            getattr(original, mode)()
            assert (model(x) - original(x)).abs().max() < 1e-12
        handle = s.tap(g, lambda a: a[..., 1, :].zero_())
        tapped = model(x)
        handle.remove()
        cloned = copy.deepcopy(original)
        s_clone = Surgeon(cloned, (x,))
        s_clone.clone(s_clone.groups[0], 2, noise_std=0.5)
        assert (cloned(x) - y0).abs().max() < 1e-9
        s.remove(g, 1)
        removed = model(x)
        reference = masked(original, x, 1)
        assert (removed - reference).abs().max() < 1e-9
        assert (tapped - reference).abs().max() < 1e-9
        by_weights = copy.deepcopy(original)  # the second oracle: channel 1's columns of fc2 zeroed
        by_weights[0].fc2.weight[:, multiplier:2 * multiplier] = 0
        assert (removed - by_weights(x)).abs().max() < 1e-9
    conv = model[0]
    assert (conv.fc1.out_channels, conv.dw.in_channels, conv.dw.groups, conv.dw.out_channels, conv.fc2.in_channels) \
        == (HIDDEN - 1, HIDDEN - 1, HIDDEN - 1, (HIDDEN - 1) * multiplier, (HIDDEN - 1) * multiplier)


def test_adam_state_follows_a_conv_channel_and_one_channel_trains() -> None:
    model, x = build(3, 2, False), inputs()
    s = Surgeon(model, (x,))
    (g,) = s.groups
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    s.attach_optimizer(opt)
    train_steps(model, opt, x)
    dw = model[0].dw.weight
    before = opt.state[dw]["exp_avg"].clone()
    s.remove(g, 0)
    assert torch.equal(opt.state[dw]["exp_avg"], before[2:])
    for _ in range(HIDDEN - 2):
        s.remove(g, 0)
    assert g.count == 1
    assert torch.isfinite(train_steps(model, opt, x))
