"""Patterns of timm's attention families, built by hand at tiny sizes: a bottleneck width read by two parallel
projections (HaloNet's query and key/value convolutions read one input); heads read by a transposed convolution
inside a module the tracer keeps opaque, in a block that hosts a group of its own (LowFormer's attention); a
depthwise transposed convolution between FFN channels. References come from the model's own layout: a unit is
masked by zeroing it in the forward, or its weight slices on a copy; the public ``tap`` is a third view of the same
masking. Cascaded heads (EfficientViT-MSRA) are pinned where they are refused; bilinear attention's (BAT's) heads are
read by two maps and masked at both; BAT's adaptive max pooling, captured through torch.export, keeps channel groups
exact."""
from __future__ import annotations

import copy
import operator
import re

import pytest
import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F
from timm.layers import register_notrace_module
from zoo import train_steps

from fxsurgery import Surgeon
from fxsurgery.capture.aten import lower

DIM, WIDTH, SIDE = 4, 5, 3


class FannedOut(nn.Module):
    """A pointwise convolution makes ``WIDTH`` channels that two parallel pointwise maps (``q``, ``kv``) both read;
    their outputs are read by projections of their own. ``zero``: the channel zeroed where both read it."""

    def __init__(self):
        super().__init__()
        self.reduce = nn.Conv2d(DIM, WIDTH, 1)
        self.norm = nn.BatchNorm2d(WIDTH)
        self.q = nn.Conv2d(WIDTH, 3, 1)
        self.kv = nn.Conv2d(WIDTH, 6, 1, bias=False)
        self.proj = nn.Conv2d(3, DIM, 1)

    def forward(self, x: torch.Tensor, zero: int | None = None) -> torch.Tensor:
        h = torch.relu(self.norm(self.reduce(x)))
        if zero is not None:
            h = h.clone()
            h[:, zero] = 0
        k, v = self.kv(h).chunk(2, dim=1)
        return x + self.proj(torch.sigmoid(self.q(h) * k) * v)


def fanned_out() -> nn.Module:
    torch.manual_seed(0)
    model = FannedOut().double()
    with torch.no_grad():
        model.norm.running_mean.uniform_(-0.5, 0.5)
        model.norm.running_var.uniform_(0.5, 1.5)
    return model


def test_a_width_read_by_two_parallel_maps_is_one_group_and_removal_equals_masking() -> None:
    model, x = fanned_out().eval(), torch.randn(2, DIM, SIDE, SIDE, dtype=torch.double)
    original = copy.deepcopy(model)
    s = Surgeon(model, (x,))
    (g,) = [g for g in s.groups if any(sl.name == "q.weight" and sl.dim == 1 for sl in g.slices)]
    assert (g.kind, g.count, g.exact) == ("channel", WIDTH, True), s.explain()
    assert {sl.name for sl in g.slices if sl.output} == {"q.weight", "kv.weight"}
    with torch.no_grad():
        y0 = original(x)
        cloned = copy.deepcopy(original)
        s_clone = Surgeon(cloned, (x,))
        (gc,) = [gc for gc in s_clone.groups if gc.name == g.name]
        s_clone.clone(gc, 2, noise_std=0.5)
        assert (cloned(x) - y0).abs().max() < 1e-9
        handle = s.tap(g, lambda a: a[..., 1, :].zero_())
        tapped = model(x)
        handle.remove()
        s.remove(g, 1)
        removed = model(x)
        reference = original(x, zero=1)
        by_weights = copy.deepcopy(original)  # the second oracle: channel 1's columns of both readers zeroed
        by_weights.q.weight[:, 1] = 0
        by_weights.kv.weight[:, 1] = 0
        assert (removed - reference).abs().max() < 1e-9
        assert (tapped - reference).abs().max() < 1e-9
        assert (removed - by_weights(x)).abs().max() < 1e-9
    assert (model.reduce.out_channels, model.norm.num_features, model.q.in_channels, model.kv.in_channels) \
        == (WIDTH - 1,) * 4


def test_adam_state_follows_a_fanned_out_channel() -> None:
    model, x = fanned_out().train(), torch.randn(2, DIM, SIDE, SIDE, dtype=torch.double)
    s = Surgeon(model, (x,))
    (g,) = [g for g in s.groups if any(sl.name == "kv.weight" and sl.dim == 1 for sl in g.slices)]
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    s.attach_optimizer(opt)
    train_steps(model, opt, x)
    before = {name: opt.state[p]["exp_avg"].clone() for name, p in
              (("q", model.q.weight), ("kv", model.kv.weight), ("reduce", model.reduce.weight))}
    s.remove(g, 0)
    assert torch.equal(opt.state[model.q.weight]["exp_avg"], before["q"][:, 1:])
    assert torch.equal(opt.state[model.kv.weight]["exp_avg"], before["kv"][:, 1:])
    assert torch.equal(opt.state[model.reduce.weight]["exp_avg"], before["reduce"][1:])
    assert torch.isfinite(train_steps(model, opt, x))


class TwoLayersRead(nn.Module):
    """A width made once and read by maps at two different values (a stream through two blocks): not one layer's
    units, so it stays refused."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(DIM, WIDTH)
        self.first = nn.Linear(WIDTH, 3)
        self.back = nn.Linear(3, WIDTH)
        self.second = nn.Linear(WIDTH, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.stem(x))
        h = h + self.back(torch.relu(self.first(h)))
        return self.second(h)


def test_a_width_read_by_maps_at_different_values_stays_refused() -> None:
    torch.manual_seed(0)
    model = TwoLayersRead().double()
    s = Surgeon(model, (torch.randn(2, DIM, dtype=torch.double),))
    assert not any(sl.name == "second.weight" for g in s.groups for sl in g.slices), s.explain()
    assert any("read by several linear maps (first.weight, second.weight)" in r for lo in s.left_out
               for r in lo.reasons), s.explain()


HEADS, HEAD_DIM = 3, 2


@register_notrace_module  # a leaf of the symbolic trace, as timm keeps its attention modules
class UpsampledAttention(nn.Module):
    """Attention on a grid pooled by 2, its heads read by a transposed convolution that upsamples back. ``zero``: the
    head whose values are zeroed before that read."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Conv2d(DIM, 3 * HEADS * HEAD_DIM, 1, bias=False)
        self.up = nn.ConvTranspose2d(HEADS * HEAD_DIM, DIM, 2, stride=2)

    def forward(self, x: torch.Tensor, zero: int | None = None) -> torch.Tensor:
        pooled = self.qkv(F.avg_pool2d(x, 2))
        b, _, h, w = pooled.shape
        q, k, v = pooled.reshape(b, HEADS, 3 * HEAD_DIM, h * w).transpose(-1, -2).chunk(3, dim=-1)
        values = F.scaled_dot_product_attention(q, k, v)
        if zero is not None:
            values = values.clone()
            values[:, zero] = 0
        return self.up(values.transpose(-1, -2).reshape(b, HEADS * HEAD_DIM, h, w))


class UpsampledBlock(nn.Module):
    """An FFN of pointwise convolutions and the opaque attention, in one block (the block hosts the FFN)."""

    def __init__(self):
        super().__init__()
        self.attn = UpsampledAttention()
        self.fc1 = nn.Conv2d(DIM, WIDTH, 1)
        self.fc2 = nn.Conv2d(WIDTH, DIM, 1)

    def forward(self, x: torch.Tensor, zero: int | None = None) -> torch.Tensor:
        x = x + self.attn(x, zero)
        return x + self.fc2(F.gelu(self.fc1(x)))


def upsampled() -> nn.Module:
    torch.manual_seed(0)
    return UpsampledBlock().double()


def test_heads_read_by_a_transposed_convolution_inside_an_opaque_module_are_a_group() -> None:
    model, x = upsampled(), torch.randn(2, DIM, 4, 4, dtype=torch.double)
    original = copy.deepcopy(model)
    s = Surgeon(model, (x,))
    (g,) = [g for g in s.groups if g.kind == "head"]
    assert (g.count, g.exact, g.module) == (HEADS, True, "attn"), s.explain()
    assert any(sl.name == "fc1.weight" for h in s.groups for sl in h.slices)  # the block hosts the FFN
    with torch.no_grad():
        y0 = original(x)
        cloned = copy.deepcopy(original)
        s_clone = Surgeon(cloned, (x,))
        s_clone.clone(next(h for h in s_clone.groups if h.kind == "head"), 1, noise_std=0.5)
        assert (cloned(x) - y0).abs().max() < 1e-9
        handle = s.tap(g, lambda a: a[..., 1, :].zero_())
        tapped = model(x)
        handle.remove()
        s.remove(g, 1)
        removed = model(x)
        reference = original(x, zero=1)
        by_weights = copy.deepcopy(original)  # the second oracle: head 1's input rows of the transposed kernel zeroed
        by_weights.attn.up.weight[HEAD_DIM:2 * HEAD_DIM] = 0
        assert (removed - reference).abs().max() < 1e-9
        assert (tapped - reference).abs().max() < 1e-9
        assert (removed - by_weights(x)).abs().max() < 1e-9
    assert (model.attn.up.in_channels, model.attn.up.out_channels) == ((HEADS - 1) * HEAD_DIM, DIM)


class PreparedUpsampledBlock(UpsampledBlock):
    """The opaque attention reads channels a convolution of the block makes: the symbolic graph cannot follow them
    into it, so the block is captured through torch.export, whose graph looks into the attention."""

    def __init__(self):
        super().__init__()
        self.pre = nn.Conv2d(DIM, DIM, 1)

    def forward(self, x: torch.Tensor, zero: int | None = None) -> torch.Tensor:
        x = x + self.attn(self.pre(x), zero)
        return x + self.fc2(F.gelu(self.fc1(x)))


def test_an_opaque_module_inside_a_captured_block_is_hosted_once() -> None:
    torch.manual_seed(0)
    model, x = PreparedUpsampledBlock().double(), torch.randn(2, DIM, 4, 4, dtype=torch.double)
    original = copy.deepcopy(model)
    s = Surgeon(model, (x,))
    assert [g.kind for g in s.groups].count("head") == 1, s.explain()  # not once more by the attention itself
    (g,) = [g for g in s.groups if g.kind == "head"]
    with torch.no_grad():
        s.remove(g, 1)
        assert (model(x) - original(x, zero=1)).abs().max() < 1e-9


def test_adam_state_follows_a_head_read_by_a_transposed_convolution() -> None:
    model, x = upsampled(), torch.randn(2, DIM, 4, 4, dtype=torch.double)
    s = Surgeon(model, (x,))
    (g,) = [g for g in s.groups if g.kind == "head"]
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    s.attach_optimizer(opt)
    train_steps(model, opt, x)
    up = model.attn.up.weight
    before = opt.state[up]["exp_avg"].clone()
    s.remove(g, 0)
    assert torch.equal(opt.state[up]["exp_avg"], before[HEAD_DIM:])
    assert torch.isfinite(train_steps(model, opt, x))


class TransposedFeedForward(nn.Module):
    """FFN channels upsampled by a depthwise transposed convolution (``multiplier`` outputs each) between the
    pointwise maps. ``zero``: the channel whose upsampled outputs (bias included) are zeroed where ``fc2`` reads
    them."""

    def __init__(self, multiplier: int, captured: bool = False):
        super().__init__()
        self.multiplier, self.captured = multiplier, captured
        self.fc1 = nn.Conv2d(DIM, WIDTH, 1)
        self.up = nn.ConvTranspose2d(WIDTH, WIDTH * multiplier, 2, stride=2, groups=WIDTH)
        self.fc2 = nn.Conv2d(WIDTH * multiplier, DIM, 1)

    def forward(self, x: torch.Tensor, zero: int | None = None) -> torch.Tensor:
        if self.captured and x.shape[-1] <= 1:  # a branch on a size: only the concrete capture reads it
            return x
        h = self.up(F.gelu(self.fc1(x)))
        if zero is not None:
            h = h.clone()
            h[:, zero * self.multiplier:(zero + 1) * self.multiplier] = 0
        return F.avg_pool2d(self.fc2(h), 2)


@pytest.mark.parametrize(("multiplier", "captured"), [(1, False), (2, False), (2, True)])
def test_channels_through_a_depthwise_transposed_convolution(multiplier: int, captured: bool) -> None:
    torch.manual_seed(0)
    model, x = TransposedFeedForward(multiplier, captured).double(), torch.randn(2, DIM, 3, 3, dtype=torch.double)
    original = copy.deepcopy(model)
    s = Surgeon(model, (x,))
    (g,) = s.groups
    assert (g.kind, g.count, g.exact) == ("channel", WIDTH, True), s.explain()
    with torch.no_grad():
        cloned = copy.deepcopy(original)
        s_clone = Surgeon(cloned, (x,))
        s_clone.clone(s_clone.groups[0], 2, noise_std=0.5)
        assert (cloned(x) - original(x)).abs().max() < 1e-9
        s.remove(g, 1)
        by_weights = copy.deepcopy(original)
        by_weights.fc2.weight[:, multiplier:2 * multiplier] = 0
        assert (model(x) - original(x, zero=1)).abs().max() < 1e-9
        assert (model(x) - by_weights(x)).abs().max() < 1e-9
    up = model.up
    assert (up.in_channels, up.groups, up.out_channels, tuple(up.weight.shape[:2])) == \
        (WIDTH - 1, WIDTH - 1, (WIDTH - 1) * multiplier, (WIDTH - 1, multiplier))


class CascadedAttention(nn.Module):
    """Cascaded group attention (EfficientViT-MSRA): head i reads its chunk of the input plus head i-1's output,
    each head with its own query/key/value map; the output projection reads every head. ``mask``: head 0's output
    zeroed where the projection reads it (``"projection"``), or also where head 1 reads it (``"everywhere"``)."""

    def __init__(self):
        super().__init__()
        self.qkvs = nn.ModuleList(nn.Conv2d(DIM // 2, 3 * HEAD_DIM, 1) for _ in range(2))
        self.proj = nn.Conv2d(2 * HEAD_DIM, DIM, 1)

    def forward(self, x: torch.Tensor, mask: str = "") -> torch.Tensor:
        b, _, h, w = x.shape
        chunks, outs, feat = x.chunk(2, dim=1), [], None
        for i, qkv in enumerate(self.qkvs):
            feat = chunks[i] if feat is None else chunks[i] + (feat * 0 if mask == "everywhere" else feat)
            q, k, v = qkv(feat).flatten(2).split(HEAD_DIM, dim=1)
            feat = (v @ (q.transpose(-2, -1) @ k).softmax(dim=-1).transpose(-2, -1)).view(b, HEAD_DIM, h, w)
            outs.append(feat * 0 if i == 0 and mask else feat)
        return self.proj(torch.cat(outs, 1))


class CascadedBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = CascadedAttention()
        self.fc1 = nn.Conv2d(DIM, WIDTH, 1)
        self.fc2 = nn.Conv2d(WIDTH, DIM, 1)

    def forward(self, x: torch.Tensor, mask: str = "") -> torch.Tensor:
        x = x + self.attn(x, mask)
        return x + self.fc2(F.gelu(self.fc1(x)))


def test_cascaded_heads_are_refused_naming_where_the_next_head_reads_them() -> None:
    """A head's output is read by its output projection and added to the next head's input. Removing head 0 means
    no output of it anywhere (head 1 then reads its own chunk alone); the tap, and a slice of the projection's
    columns, mask it at the projection only, where it still feeds head 1: in float64 the two differ by O(1), and
    no slice of a tensor rewires the cascade, so the heads are refused at the node where head 1 reads them."""
    torch.manual_seed(0)
    model, x = CascadedBlock().double(), torch.randn(2, DIM, 3, 3, dtype=torch.double)
    with torch.no_grad():
        assert (model(x, "projection") - model(x, "everywhere")).abs().max() > 1e-2
    s = Surgeon(model, (x,))
    assert [g.kind for g in s.groups] == ["channel"], s.explain()  # the FFN only
    (reason,) = [r for lo in s.left_out if lo.module == "attn" for r in lo.reasons]
    assert reason.startswith("attention heads that feed later heads: attn.qkvs.1.weight reads some of them at "
                             "add, besides their output projection attn.proj.weight"), reason
    assert "removing a head would rewire the cascade and a clone would read another input" in reason, reason


GROUPS, CHANNELS, BLOCK = 2, 2, 2


class BilinearTransform(nn.Module):
    """Bilinear attention (timm's BAT): ``conv1`` reads every channel and makes the pooled statistics from which
    ``conv_p``/``conv_q`` make one normalised BLOCK×BLOCK transform pair per head; head g transforms its own
    CHANNELS channels (``p @ h @ q``), and ``conv2`` reads them all. ``zero``: the head whose channels are zeroed
    where ``conv1`` reads them and, transformed, where ``conv2`` does; ``only_conv2``: at ``conv2``'s read alone."""

    def __init__(self):
        super().__init__()
        self.reduce = nn.Conv2d(DIM, CHANNELS * GROUPS, 1)
        self.norm = nn.BatchNorm2d(CHANNELS * GROUPS)
        self.conv1 = nn.Conv2d(CHANNELS * GROUPS, 3, 1)
        self.conv_p = nn.Conv2d(3, BLOCK * BLOCK * GROUPS, (BLOCK, 1))
        self.conv_q = nn.Conv2d(3, BLOCK * BLOCK * GROUPS, (1, BLOCK))
        self.conv2 = nn.Conv2d(CHANNELS * GROUPS, DIM, 1)

    def transform(self, conv: nn.Module, stats: torch.Tensor, dim: int) -> torch.Tensor:
        b = stats.shape[0]
        t = conv(stats).view(b, GROUPS, BLOCK, BLOCK).sigmoid()
        t = (t / t.sum(dim=dim, keepdim=True)).view(b, GROUPS, 1, BLOCK, BLOCK)
        return t.expand(b, GROUPS, CHANNELS, BLOCK, BLOCK).reshape(b, CHANNELS * GROUPS, BLOCK, BLOCK)

    def forward(self, x: torch.Tensor, zero: int | None = None, only_conv2: bool = False) -> torch.Tensor:
        return x + self.conv2(transformed(self, torch.relu(self.norm(self.reduce(x))), zero, only_conv2))


def transformed(m: nn.Module, h: torch.Tensor, zero: int | None, only_conv2: bool = False) -> torch.Tensor:
    """The heads of ``h`` transformed by ``m``'s pairs (``p @ h @ q``, made by ``m.conv1`` from every head), head
    ``zero`` zeroed where ``m.conv1`` reads it (unless ``only_conv2``) and once transformed."""
    head = slice(CHANNELS * zero, CHANNELS * (zero + 1)) if zero is not None else slice(0)
    read = h.clone()
    if not only_conv2:
        read[:, head] = 0
    stats = torch.relu(m.conv1(read))
    p = m.transform(m.conv_p, F.adaptive_avg_pool2d(stats, (BLOCK, 1)), 3)
    q = m.transform(m.conv_q, F.adaptive_avg_pool2d(stats, (1, BLOCK)), 2)
    y = p.matmul(h).matmul(q)
    y[:, head] = 0
    return y


def bilinear() -> nn.Module:
    torch.manual_seed(0)
    model = BilinearTransform().double()
    with torch.no_grad():
        model.norm.running_mean.uniform_(-0.5, 0.5)
        model.norm.running_var.uniform_(0.5, 1.5)
    return model


def zero_bilinear_head_1(copied: nn.Module) -> None:
    """The weights' oracle: head 1's columns zeroed in both maps that read its channels."""
    copied.conv1.weight[:, CHANNELS:2 * CHANNELS] = 0
    copied.conv2.weight[:, CHANNELS:2 * CHANNELS] = 0


@pytest.mark.parametrize("training", [True, False])
def test_bilinear_attention_heads_are_a_group_masked_at_both_reads(training: bool) -> None:
    """A head's transform is normalised over its own coordinates (``t / t.sum(dim)``), which keeps its ids; a head
    with its channels is read by ``conv1``, which makes every head's transform, and by ``conv2``: removing it equals
    masking it at both reads (the columns of both maps), which is what its tap point sees. Masking at ``conv2``
    alone differs."""
    model, x = bilinear().train(training), torch.randn(2, DIM, BLOCK, BLOCK, dtype=torch.double)
    original = copy.deepcopy(model)
    s = Surgeon(model, (x,))
    (g,) = s.groups
    assert (g.kind, g.count, g.exact) == ("head", GROUPS, True), s.explain()
    assert {sl.name for sl in g.slices if sl.output} == {"conv1.weight", "conv2.weight"}
    with torch.no_grad():
        assert (original(x, zero=1) - original(x, zero=1, only_conv2=True)).abs().max() > 1e-4
    assert_clone_and_removal_of_unit_1(original, model, s, x, clone=0, zero_weights=zero_bilinear_head_1)
    assert (model.conv1.in_channels, model.conv2.in_channels, model.norm.num_features) == (CHANNELS,) * 3
    assert (model.conv_p.out_channels, model.conv_q.out_channels) == (BLOCK * BLOCK,) * 2


@register_notrace_module
class KeptWholeTransform(nn.Module):
    """The transform of a bilinear attention as timm keeps it: whole (a call its caller's symbolic graph has no rule
    for), reading heads its caller makes. ``zero`` as in ``BilinearTransform``."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(CHANNELS * GROUPS, 3, 1)
        self.conv_p = nn.Conv2d(3, BLOCK * BLOCK * GROUPS, (BLOCK, 1))
        self.conv_q = nn.Conv2d(3, BLOCK * BLOCK * GROUPS, (1, BLOCK))
        self.conv2 = nn.Conv2d(CHANNELS * GROUPS, DIM, 1)

    transform = BilinearTransform.transform

    def forward(self, h: torch.Tensor, zero: int | None = None) -> torch.Tensor:
        return self.conv2(transformed(self, h, zero))


class BilinearCaller(nn.Module):
    """A bilinear attention block whose heads are made here (``reduce``) and transformed and read inside a module the
    symbolic trace keeps whole: no group of it can be located in the symbolic graph."""

    def __init__(self):
        super().__init__()
        self.reduce = nn.Conv2d(DIM, CHANNELS * GROUPS, 1)
        self.attn = KeptWholeTransform()

    def forward(self, x: torch.Tensor, zero: int | None = None) -> torch.Tensor:
        return x + self.attn(torch.relu(self.reduce(x)), zero=zero)


def test_a_model_whose_symbolic_graph_locates_no_group_is_analysed_whole() -> None:
    """Where the symbolic graph locates no group (the heads are inside a module it keeps whole), the model is analysed
    whole and the concrete-shape capture sees into that module: its heads are a group, exact under both oracles."""
    torch.manual_seed(0)
    model = BilinearCaller().double()
    x = torch.randn(2, DIM, BLOCK, BLOCK, dtype=torch.double)
    original = copy.deepcopy(model)
    s = Surgeon(model, (x,))
    assert "torch.export" in s.explain(), s.explain()
    (g,) = s.groups
    assert (g.kind, g.count, g.exact) == ("head", GROUPS, True), s.explain()

    def zero_head_1(copied: nn.Module) -> None:
        zero_bilinear_head_1(copied.attn)

    assert_clone_and_removal_of_unit_1(original, model, s, x, clone=0, zero_weights=zero_head_1)
    assert (model.attn.conv1.in_channels, model.attn.conv2.in_channels) == (CHANNELS, CHANNELS)


def test_adam_state_follows_a_bilinear_attention_head() -> None:
    model, x = bilinear(), torch.randn(2, DIM, BLOCK, BLOCK, dtype=torch.double)
    s = Surgeon(model, (x,))
    (g,) = s.groups
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    s.attach_optimizer(opt)
    train_steps(model, opt, x)
    names = ("reduce", "conv1", "conv_p", "conv2")
    before = {name: opt.state[getattr(model, name).weight]["exp_avg"].clone() for name in names}
    s.remove(g, 0)
    assert torch.equal(opt.state[model.reduce.weight]["exp_avg"], before["reduce"][CHANNELS:])
    assert torch.equal(opt.state[model.conv1.weight]["exp_avg"], before["conv1"][:, CHANNELS:])
    assert torch.equal(opt.state[model.conv_p.weight]["exp_avg"], before["conv_p"][BLOCK * BLOCK:])
    assert torch.equal(opt.state[model.conv2.weight]["exp_avg"], before["conv2"][:, CHANNELS:])
    assert torch.isfinite(train_steps(model, opt, x))


class MaxPooledGate(nn.Module):
    """A channel width pooled by an adaptive max pool and read by a pointwise map. The forward branches on the input
    size, so the model is captured through torch.export, whose graph records ATen's adaptive max pooling. ``zero``:
    the channel zeroed before the pooling."""

    def __init__(self):
        super().__init__()
        self.reduce = nn.Conv2d(DIM, WIDTH, 1)
        self.expand = nn.Conv2d(WIDTH, DIM, 1)

    def forward(self, x: torch.Tensor, zero: int | None = None) -> torch.Tensor:
        h = torch.relu(self.reduce(x))
        if zero is not None:
            h = h.clone()
            h[:, zero] = 0
        size = (BLOCK, 1) if x.shape[-1] % BLOCK == 0 else (1, 1)
        return x * torch.sigmoid(self.expand(F.adaptive_max_pool2d(h, size)))


def assert_clone_and_removal_of_unit_1(original: nn.Module, model: nn.Module, s: Surgeon, x: torch.Tensor, *,
                                       clone: int, zero_weights) -> None:
    """A clone of unit ``clone`` (on a fresh copy) keeps the outputs; removing unit 1 of ``model``'s one group
    equals zeroing it in the forward (``original(x, zero=1)``), through ``tap``, and on a copy of the original
    whose weights ``zero_weights`` zeroes."""
    (g,) = s.groups
    with torch.no_grad():
        y0 = original(x)
        cloned = copy.deepcopy(original)
        s_clone = Surgeon(cloned, (x,))
        s_clone.clone(s_clone.groups[0], clone, noise_std=0.5)
        assert (cloned(x) - y0).abs().max() < 1e-9
        handle = s.tap(g, lambda a: a[..., 1, :].zero_())
        tapped = model(x)
        handle.remove()
        s.remove(g, 1)
        removed = model(x)
        reference = original(x, zero=1)
        by_weights = copy.deepcopy(original)
        zero_weights(by_weights)
        assert (removed - reference).abs().max() < 1e-9
        assert (tapped - reference).abs().max() < 1e-9
        assert (removed - by_weights(x)).abs().max() < 1e-9


def test_a_channel_group_through_a_captured_adaptive_max_pool_is_exact() -> None:
    torch.manual_seed(0)
    model, x = MaxPooledGate().double(), torch.randn(2, DIM, BLOCK, 2 * BLOCK, dtype=torch.double)
    original = copy.deepcopy(model)
    s = Surgeon(model, (x,))
    assert "torch.export" in s.explain(), s.explain()
    (g,) = s.groups
    assert (g.kind, g.count, g.exact) == ("channel", WIDTH, True), s.explain()
    def zero_channel_1(copied: nn.Module) -> None:  # the second oracle: channel 1's column of the reader zeroed
        copied.expand.weight[:, 1] = 0

    assert_clone_and_removal_of_unit_1(original, model, s, x, clone=2, zero_weights=zero_channel_1)
    assert (model.reduce.out_channels, model.expand.in_channels) == (WIDTH - 1,) * 2


LENGTH = 5


class MadeWeights(nn.Module):
    """Attention whose per-head weights a linear map makes from each token (no query·key product), each head's
    normalised over its own coordinates (``w / w.sum(dim)``, as BAT normalises its transforms). ``zero``: the head
    whose values are zeroed before the output projection."""

    def __init__(self):
        super().__init__()
        self.weights = nn.Linear(DIM, HEADS * LENGTH)
        self.v = nn.Linear(DIM, HEADS * HEAD_DIM)
        self.proj = nn.Linear(HEADS * HEAD_DIM, DIM)

    def forward(self, x: torch.Tensor, zero: int | None = None) -> torch.Tensor:
        b, n, _ = x.shape
        w = self.weights(x).view(b, n, HEADS, LENGTH).transpose(1, 2).sigmoid()
        w = w / w.sum(dim=-1, keepdim=True)
        out = w @ self.v(x).view(b, n, HEADS, HEAD_DIM).transpose(1, 2)
        if zero is not None:
            out = out.clone()
            out[:, zero] = 0
        return x + self.proj(out.transpose(1, 2).reshape(b, n, HEADS * HEAD_DIM))


def test_heads_normalised_over_their_own_coordinates_are_an_exact_group() -> None:
    torch.manual_seed(0)
    model, x = MadeWeights().double(), torch.randn(2, LENGTH, DIM, dtype=torch.double)
    original = copy.deepcopy(model)
    s = Surgeon(model, (x,))
    (g,) = s.groups
    assert (g.kind, g.count, g.exact) == ("head", HEADS, True), s.explain()
    def zero_head_1(copied: nn.Module) -> None:  # the second oracle: head 1's columns of the output projection zeroed
        copied.proj.weight[:, HEAD_DIM:2 * HEAD_DIM] = 0

    assert_clone_and_removal_of_unit_1(original, model, s, x, clone=1, zero_weights=zero_head_1)
    assert (model.weights.out_features, model.v.out_features) == ((HEADS - 1) * LENGTH, (HEADS - 1) * HEAD_DIM)


def test_a_reduction_over_coordinates_of_several_units_is_inexact() -> None:
    """The same weights normalised over all heads at once (``w / w.sum((1, 3))``): the sum mixes heads, so
    removing one changes the others and the group is inexact, named at the reduction."""
    class Mixed(MadeWeights):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, n, _ = x.shape
            w = self.weights(x).view(b, n, HEADS, LENGTH).transpose(1, 2).sigmoid()
            w = w / w.sum(dim=(1, 3), keepdim=True)
            out = w @ self.v(x).view(b, n, HEADS, HEAD_DIM).transpose(1, 2)
            return x + self.proj(out.transpose(1, 2).reshape(b, n, HEADS * HEAD_DIM))

    torch.manual_seed(0)
    s = Surgeon(Mixed().double(), (torch.randn(2, LENGTH, DIM, dtype=torch.double),))
    assert not any(g.exact and g.kind == "head" for g in s.groups), s.explain()
    assert re.search(r"note: sum\w*: reduction", s.explain()), s.explain()


def test_a_size_computed_from_a_literal_for_several_views_is_copied_per_view() -> None:
    """torch.export computes ``batch * 16`` once for every block built alike that views by it; lowering gives each
    view its own copy, so a count constant rewritten for one block's units leaves the others' sizes alone. A size of
    sizes alone (no literal to rewrite) stays shared."""
    graph = torch.fx.Graph()
    x, batch, width = graph.placeholder("x"), graph.placeholder("batch"), graph.placeholder("width")
    by_literal, by_sizes = graph.call_function(operator.mul, (batch, 16)), graph.call_function(operator.mul,
                                                                                             (batch, width))
    views = [graph.call_method("view", (x, by_literal, by_sizes)) for _ in range(3)]
    graph.output(tuple(views))
    lower(graph)
    literal_sizes = [view.args[1] for view in views]
    assert len(set(literal_sizes)) == 3 and all(s.target is operator.mul and s.args == (batch, 16)
                                                 for s in literal_sizes)
    assert {view.args[2] for view in views} == {by_sizes}
    graph.lint()


def test_a_transpose_of_every_dim_is_lowered_to_the_permute_it_is() -> None:
    """``W.T`` (Falcon's linear layers: ``x @ self.weight.T``) is ``aten.numpy_T`` in an exported graph: lowered to
    the permute reversing every dim, which the view rules read (it had no rule, and hid the weight's units)."""
    class Transposed(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(2, 3, 4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ self.weight.T.reshape(4, 6)

    graph = torch.export.export(Transposed(), (torch.randn(5, 4),)).graph_module.graph
    assert any(n.target is torch.ops.aten.numpy_T.default for n in graph.nodes)
    lower(graph)
    (permute,) = [n for n in graph.nodes if n.target == "permute"]
    assert permute.args[1:] == (2, 1, 0)
