"""fxsurgery on convolutional gates and windowed attention: a softmax over kernel branches or channel groups
is told at its module (no heads), attention's softmax is not; heads folded into the batch with padded,
unfolded key/value windows are a head group whose sizes follow the batch at run time."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from zoo import Style, TinyTransformer

from fxsurgery import Surgeon


class BranchGate(nn.Module):
    """Weights two kernel branches per channel by a softmax over the branches (a selective-kernel gate): a
    pooled bottleneck (1x1 conv, batch norm, ReLU) then a 1x1 conv to one logit per branch and channel."""

    def __init__(self, channels: int = 4, hidden: int = 3, paths: int = 2):
        super().__init__()
        self.paths = paths
        self.reduce = nn.Conv2d(channels, hidden, 1)
        self.bn = nn.BatchNorm2d(hidden)
        self.select = nn.Conv2d(hidden, channels * paths, 1)

    def forward(self, branches: torch.Tensor) -> torch.Tensor:
        x = self.reduce(branches.sum(1).mean((2, 3), keepdim=True))
        x = self.select(F.relu(self.bn(x)))
        B, C, H, W = x.shape
        return torch.softmax(x.view(B, self.paths, C // self.paths, H, W), dim=1)


class SelectiveKernel(nn.Module):
    def __init__(self, channels: int = 4):
        super().__init__()
        self.branches = nn.ModuleList(nn.Conv2d(channels, channels, k, padding=k // 2) for k in (3, 5))
        self.gate = BranchGate(channels)
        self.out = nn.Conv2d(channels, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        branches = torch.stack([conv(x) for conv in self.branches], dim=1)
        return self.out((branches * self.gate(branches)).sum(1)).mean((2, 3))


def test_a_softmax_over_kernel_branches_is_told_at_its_module() -> None:
    torch.manual_seed(0)
    model = SelectiveKernel().double().eval()
    s = Surgeon(model, (torch.randn(2, 4, 6, 6, dtype=torch.double),))
    told = [r for lo in s.left_out if lo.module == "gate" for r in lo.reasons]
    assert told == ["softmax: no heads: a softmax over 2 feature groups of one tensor (the outputs of gate.select), "
                    "not over a query·key product"]
    hidden = [g for g in s.groups if g.module == "gate"]  # the bottleneck's channels are a group all the same
    assert [(g.kind, g.count, g.exact) for g in hidden] == [("channel", 3, True)]
    assert "no heads" in s.explain()


def test_attention_softmax_is_not_told() -> None:
    torch.manual_seed(0)
    model = TinyTransformer(Style(product="matmul")).double().eval()
    s = Surgeon(model, (torch.randn(2, 5, 5, dtype=torch.double),))
    assert {g.kind for g in s.groups} == {"head", "channel"}
    assert not [r for lo in s.left_out for r in lo.reasons if "no heads" in r]


class HaloAttention(nn.Module):
    """Blocked local attention with heads folded into the batch: queries per block from one 1x1 conv, keys
    and values from another over padded, overlapping windows (``Tensor.unfold``); no output projection of
    its own (the heads go through batch norm into the next 1x1 conv)."""

    def __init__(self, dim: int = 4, heads: int = 3, head_dim: int = 2, block: int = 2, halo: int = 1):
        super().__init__()
        self.heads, self.hd, self.block, self.halo = heads, head_dim, block, halo
        self.win = block + 2 * halo
        self.q = nn.Conv2d(dim, heads * head_dim, 1)
        self.kv = nn.Conv2d(dim, heads * 2 * head_dim, 1)
        self.bn = nn.BatchNorm2d(heads * head_dim)
        self.proj = nn.Conv2d(heads * head_dim, dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, C, H, W = x.shape
        nh, nw, bs = H // self.block, W // self.block, self.block
        q = self.q(x).reshape(-1, self.hd, nh, bs, nw, bs).permute(0, 1, 3, 5, 2, 4)
        q = q.reshape(B * self.heads, self.hd, -1, nh * nw).transpose(1, 3)
        kv = F.pad(self.kv(x), [self.halo] * 4)
        kv = kv.unfold(2, self.win, bs).unfold(3, self.win, bs).reshape(
            B * self.heads, 2 * self.hd, nh * nw, -1).permute(0, 2, 3, 1)
        k, v = torch.split(kv, [self.hd, self.hd], dim=-1)
        attn = (q @ k.transpose(-1, -2) * self.hd ** -0.5).softmax(dim=-1)
        out = (attn @ v).transpose(1, 3).reshape(-1, bs, bs, nh, nw).permute(0, 3, 1, 4, 2)
        out = out.contiguous().view(B, self.heads * self.hd, H, W)
        return x + self.proj(F.relu(self.bn(out)))


@pytest.mark.parametrize("removed", [0, 2])
def test_heads_folded_into_the_batch_follow_the_batch_at_run_time(removed: int) -> None:
    torch.manual_seed(0)
    model = HaloAttention().double().eval()
    with torch.no_grad():
        model.bn.running_mean.normal_()
    x = torch.randn(2, 4, 4, 4, dtype=torch.double)
    masked = copy.deepcopy(model)
    s = Surgeon(model, (x,))
    (g,) = s.groups
    assert (g.kind, g.count, g.exact) == ("head", 3, True)
    with torch.no_grad():  # the removed head's columns of the projection that reads it (through batch norm)
        masked.proj.weight[:, removed * 2:(removed + 1) * 2] = 0
    s.remove(g, removed)
    bigger = torch.randn(5, 4, 6, 6, dtype=torch.double)  # another batch and another grid than the analysis saw
    with torch.no_grad():
        torch.testing.assert_close(model(bigger), masked(bigger), rtol=1e-9, atol=1e-9)
    s.clone(g, 0)
    assert g.count == 3 and model(bigger).shape == bigger.shape
