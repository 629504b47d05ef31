"""Attention patterns beyond the plain product: locality self-attention (a diagonal ``masked_fill`` and a learned
scalar temperature), batch norm over the projections' unit channels (module, functional and captured) with LeViT's
per-head position bias from an ``nn.Embedding``, and Swin v2's cosine attention (``F.normalize``, a clamped per-head
logit scale, a position-bias MLP per block) and SAM's decomposed relative positions (tables of head_dim columns
shared by every head, gathered by a function the tracer cannot look into, read through the query). Each model's
references come from its own layout (the output projection's columns of a head), never from fxsurgery's slices; a
failing rule is a refusal naming its node."""
from __future__ import annotations

import copy
import math
from typing import Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from zoo import masked_copy, train_steps

import fxsurgery
from fxsurgery import AnalysisError, Surgeon

DIM, HEADS, HEAD_DIM, TOKENS = 6, 2, 3, 4
INNER = HEADS * HEAD_DIM


def _close(a: torch.Tensor, b: torch.Tensor, tol: float) -> bool:
    return bool((a - b).abs().max() <= tol * max(1.0, float(b.abs().max())))


def _head(s: Surgeon) -> fxsurgery.UnitGroup:
    heads = [g for g in s.groups if g.kind == "head"]
    assert len(heads) == 1, s.explain()
    return heads[0]


class Residual(nn.Module):
    """Embedding, one attention block with a residual, mean pooling and a classifier: tokens ``(b, n, 5)`` or
    images ``(b, 3, h, w)`` (``channels_first``)."""

    def __init__(self, attn: nn.Module, channels_first: bool = False):
        super().__init__()
        self.channels_first = channels_first
        self.embed = nn.Conv2d(3, DIM, 1) if channels_first else nn.Linear(5, DIM)
        self.attn, self.head = attn, nn.Linear(DIM, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        x = x + self.attn(x)
        return self.head(x.mean((2, 3)) if self.channels_first else x.mean(1))


class Attention(nn.Module):
    """``captured``: the forward branches on a size, which the symbolic tracer cannot follow, so the captured graph
    serves."""

    def __init__(self, captured: bool):
        super().__init__()
        self.captured = captured

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.captured and x.shape[-1] <= 1:
            return x
        return self.attend(x)


class LocalityAttention(Attention):
    """vit-pytorch's locality self-attention: a learned scalar temperature, and each token's own logit masked out by
    a diagonal ``masked_fill`` (``how``: the tensor method, its in-place variant, or ``torch.masked_fill``)."""

    def __init__(self, how: str = "method", captured: bool = False):
        super().__init__(captured)
        self.how = how
        self.temperature = nn.Parameter(torch.log(torch.tensor(HEAD_DIM ** -0.5)))
        self.qkv, self.out = nn.Linear(DIM, 3 * INNER, bias=False), nn.Linear(INNER, DIM)

    def attend(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, HEADS, HEAD_DIM).permute(2, 0, 3, 1, 4).unbind(0)
        dots = q @ k.transpose(-1, -2) * self.temperature.exp()
        mask = torch.eye(dots.shape[-1], device=dots.device, dtype=torch.bool)
        fill = -1e9
        if self.how == "method":
            dots = dots.masked_fill(mask, fill)
        elif self.how == "in_place":
            dots.masked_fill_(mask, fill)
        else:
            dots = torch.masked_fill(dots, mask, fill)
        out = dots.softmax(-1) @ v
        return self.out(out.transpose(1, 2).reshape(b, n, INNER))


class BatchNormedAttention(Attention):
    """LeViT's attention: q, k, v and the output are 1x1 convolutions followed by batch norm over their channels
    (the q/k/v norms over the heads' channels), as modules or through ``F.batch_norm`` (``functional``); the logits
    get a per-head bias looked up in an ``nn.Embedding(positions, heads)`` by a buffer of relative positions."""

    def __init__(self, functional: bool = False, captured: bool = False):
        super().__init__(captured)
        self.functional = functional
        self.q, self.k, self.v = (nn.Conv2d(DIM, INNER, 1, bias=False) for _ in range(3))
        self.q_norm, self.k_norm, self.v_norm = (nn.BatchNorm2d(INNER) for _ in range(3))
        self.out, self.out_norm = nn.Conv2d(INNER, DIM, 1), nn.BatchNorm2d(DIM)
        for norm in (self.q_norm, self.k_norm, self.v_norm, self.out_norm):
            _vary_per_channel(norm)
        self.pos_bias = nn.Embedding(TOKENS, HEADS)
        pos = torch.arange(TOKENS)
        self.register_buffer("pos_indices", (pos[:, None] - pos[None, :]).abs())

    def norm(self, bn: nn.BatchNorm2d, x: torch.Tensor) -> torch.Tensor:
        if not self.functional:
            return bn(x)
        return F.batch_norm(x, bn.running_mean, bn.running_var, bn.weight, bn.bias, self.training, bn.momentum,
                            bn.eps)

    def attend(self, x: torch.Tensor) -> torch.Tensor:
        b, _, h, w = x.shape
        q, k, v = (self.norm(bn, proj(x)).reshape(b, HEADS, HEAD_DIM, h * w)
                   for proj, bn in ((self.q, self.q_norm), (self.k, self.k_norm), (self.v, self.v_norm)))
        bias = self.pos_bias(self.pos_indices).permute(2, 0, 1)
        attn = (q.transpose(-2, -1) @ k * HEAD_DIM ** -0.5 + bias).softmax(-1)
        out = (v @ attn.transpose(-2, -1)).reshape(b, INNER, h, w)
        return self.norm(self.out_norm, self.out(out))


class TokenBatchNormedAttention(Attention):
    """A fused q/k/v projection whose channels are batch-normed over the batch and the tokens (``BatchNorm1d`` of
    ``(b, channels, tokens)``): Linear maps, so only the batch norm needs a channel left."""

    def __init__(self):
        super().__init__(captured=False)
        self.qkv, self.norm = nn.Linear(DIM, 3 * INNER, bias=False), nn.BatchNorm1d(3 * INNER)
        self.out = nn.Linear(INNER, DIM)
        _vary_per_channel(self.norm)

    def attend(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = self.norm(self.qkv(x).transpose(1, 2)).reshape(b, 3, HEADS, HEAD_DIM, n).unbind(1)
        attn = (q.transpose(-2, -1) @ k * HEAD_DIM ** -0.5).softmax(-1)
        return self.out((attn @ v.transpose(-2, -1)).transpose(1, 2).reshape(b, n, INNER))


def _vary_per_channel(norm: nn.BatchNorm1d | nn.BatchNorm2d) -> None:
    """Statistics and affine maps that differ per channel."""
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.normal_()
        norm.running_mean.normal_()
        norm.running_var.uniform_(0.5, 2.0)


class CosineAttention(Attention):
    """Swin v2's attention: cosine similarity of normalised queries and keys, scaled per head by a learned logit
    scale (clamped, then exponentiated), plus a per-head bias made by a small MLP of relative coordinates; the heads
    are merged with Hugging Face's ``size()[:-2] + (width,)``."""

    def __init__(self, captured: bool = False):
        super().__init__(captured)
        self.q, self.k, self.v = (nn.Linear(DIM, INNER) for _ in range(3))
        self.logit_scale = nn.Parameter(torch.log(10 * torch.rand(HEADS, 1, 1) + 1))
        self.position_mlp = nn.Sequential(nn.Linear(2, 8), nn.ReLU(), nn.Linear(8, HEADS, bias=False))
        pos = torch.arange(TOKENS, dtype=torch.float32)
        rel = pos[:, None] - pos[None, :]
        self.register_buffer("coords", torch.stack([rel, rel.abs()], -1) / TOKENS, persistent=False)
        self.out = nn.Linear(INNER, DIM)

    def attend(self, x: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        q, k, v = (proj(x).view(b, -1, HEADS, HEAD_DIM).transpose(1, 2) for proj in (self.q, self.k, self.v))
        scores = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1)
        scores = scores * torch.clamp(self.logit_scale, max=math.log(100.0)).exp()
        bias = self.position_mlp(self.coords.to(x.dtype)).permute(2, 0, 1)
        scores = scores + 16 * torch.sigmoid(bias).unsqueeze(0)
        out = (scores.softmax(-1) @ v).permute(0, 2, 1, 3).contiguous()
        return self.out(out.view(out.size()[:-2] + (INNER,)))


class ShiftedWindowAttention(Attention):
    """Swin's shifted-window attention as Hugging Face writes it: a relative-position bias table gathered per head
    plus the cyclic-shift mask (plain: built from sizes, -100 between regions), expanded over the batch and added to
    the bias before the product (``sdpa``: one attention mask; else logits, softmax, product)."""

    def __init__(self, sdpa: bool = True, captured: bool = False):
        super().__init__(captured)
        self.sdpa = sdpa
        self.qkv, self.out = nn.Linear(DIM, 3 * INNER), nn.Linear(INNER, DIM)
        self.table = nn.Parameter(torch.randn(2 * TOKENS - 1, HEADS))
        pos = torch.arange(TOKENS)
        self.register_buffer("index", (pos[:, None] - pos[None, :] + TOKENS - 1).flatten(), persistent=False)

    def attend(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, HEADS, HEAD_DIM).permute(2, 0, 3, 1, 4).unbind(0)
        bias = self.table[self.index].view(n, n, HEADS).permute(2, 0, 1).unsqueeze(0)
        region = torch.arange(n, device=x.device) >= n // 2
        mask = (region[:, None] != region[None, :]).to(x.dtype) * -100.0
        mask = bias + mask.unsqueeze(0).unsqueeze(0).expand(b, -1, -1, -1)
        if self.sdpa:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            out = ((q @ k.transpose(-2, -1)) * HEAD_DIM ** -0.5 + mask).softmax(-1) @ v
        return self.out(out.transpose(1, 2).reshape(b, n, INNER))


def gathered_positions(size: int, table: torch.Tensor) -> torch.Tensor:
    """Rows of a relative-position table (``2·size−1`` distances × head_dim) for every query/key pair: (size, size,
    head_dim). Wrapped for the symbolic tracer (SAM's ``get_rel_pos``), so its output is a tensor with no
    labels, read whole by every head."""
    if table.shape[0] != 2 * size - 1:  # control flow on a size: the tracer cannot look inside
        raise ValueError("a table for another size")
    pos = torch.arange(size, device=table.device)
    return table[pos[:, None] - pos[None, :] + size - 1]


torch.fx.wrap("gathered_positions")


class DecomposedRelPosAttention(Attention):
    """SAM's attention: heads folded into the batch (``b·heads``), relative positions decomposed along the height
    and width of a 2×2 token grid, tables of ``head_dim`` columns shared by every head, read through the query
    (``einsum("bhwc,hkc->bhwk")``) and added to the logits as an attention mask."""

    def __init__(self, sdpa: bool = True, captured: bool = False):
        super().__init__(captured)
        self.sdpa = sdpa
        self.qkv, self.out = nn.Linear(DIM, 3 * INNER), nn.Linear(INNER, DIM)
        self.rel_h, self.rel_w = (nn.Parameter(torch.randn(3, HEAD_DIM)) for _ in range(2))

    def attend(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        side = math.isqrt(TOKENS)
        q, k, v = self.qkv(x).view(b, n, 3, HEADS, -1).permute(2, 0, 3, 1, 4).reshape(3, b * HEADS, n, -1).unbind(0)
        grid = q.reshape(-1, side, side, HEAD_DIM)
        rel_h = torch.einsum("bhwc,hkc->bhwk", grid, gathered_positions(side, self.rel_h))
        rel_w = torch.einsum("bhwc,wkc->bhwk", grid, gathered_positions(side, self.rel_w))
        bias = (rel_h[:, :, :, :, None] + rel_w[:, :, :, None, :]).reshape(-1, n, n)
        if self.sdpa:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        else:
            out = ((q * HEAD_DIM ** -0.5) @ k.transpose(-2, -1) + bias).softmax(-1) @ v
        return self.out(out.view(b, HEADS, n, -1).transpose(1, 2).reshape(b, n, -1))


def _tokens() -> torch.Tensor:
    return torch.randn(2, TOKENS, 5, dtype=torch.double)


def _images() -> torch.Tensor:
    return torch.randn(2, 3, 2, 2, dtype=torch.double)


# name -> (model builder, example input, output projection of the heads, captured)
PATTERNS: dict[str, tuple[Callable[[], nn.Module], Callable[[], torch.Tensor], str, bool]] = {
    "locality_method": (lambda: Residual(LocalityAttention("method")), _tokens, "attn.out.weight", False),
    "locality_in_place": (lambda: Residual(LocalityAttention("in_place")), _tokens, "attn.out.weight", False),
    "locality_function": (lambda: Residual(LocalityAttention("function")), _tokens, "attn.out.weight", False),
    "locality_captured": (lambda: Residual(LocalityAttention(captured=True)), _tokens, "attn.out.weight", True),
    "batch_norm_module": (lambda: Residual(BatchNormedAttention(), True), _images, "attn.out.weight", False),
    "batch_norm_functional": (lambda: Residual(BatchNormedAttention(functional=True), True), _images,
                              "attn.out.weight", False),
    "batch_norm_captured": (lambda: Residual(BatchNormedAttention(captured=True), True), _images,
                            "attn.out.weight", True),
    "batch_norm_tokens": (lambda: Residual(TokenBatchNormedAttention()), _tokens, "attn.out.weight", False),
    "cosine": (lambda: Residual(CosineAttention()), _tokens, "attn.out.weight", False),
    "cosine_captured": (lambda: Residual(CosineAttention(captured=True)), _tokens, "attn.out.weight", True),
    "shifted_window_sdpa": (lambda: Residual(ShiftedWindowAttention()), _tokens, "attn.out.weight", False),
    "shifted_window_eager": (lambda: Residual(ShiftedWindowAttention(sdpa=False)), _tokens, "attn.out.weight", False),
    "shifted_window_captured": (lambda: Residual(ShiftedWindowAttention(captured=True)), _tokens, "attn.out.weight",
                                True),
    "decomposed_rel_pos_sdpa": (lambda: Residual(DecomposedRelPosAttention()), _tokens, "attn.out.weight", False),
    "decomposed_rel_pos_eager": (lambda: Residual(DecomposedRelPosAttention(sdpa=False)), _tokens, "attn.out.weight",
                                 False),
    "decomposed_rel_pos_captured": (lambda: Residual(DecomposedRelPosAttention(captured=True)), _tokens,
                                    "attn.out.weight", True),
}


def _built(name: str, mode: str = "eval") -> tuple[nn.Module, torch.Tensor, str]:
    build, inputs, out_weight, _ = PATTERNS[name]
    torch.manual_seed(0)
    model = build().double()
    getattr(model, mode)()
    return model, inputs(), out_weight


def _zeroing(unit: int) -> Callable[[torch.Tensor], None]:
    def zero(a: torch.Tensor) -> None:
        a[..., unit, :] = 0
    return zero


@pytest.mark.parametrize("name", list(PATTERNS))
@pytest.mark.parametrize("mode", ["eval", "train"])
def test_heads_clone_unchanged_and_removal_equals_masking_and_tap(name: str, mode: str) -> None:
    original, x, out_weight = _built(name, mode)
    model = copy.deepcopy(original)
    s = Surgeon(model, (x,))
    head = _head(s)
    assert head.exact and head.count == HEADS
    assert ("torch.export" in s.explain()) == PATTERNS[name][3]
    assert_head_oracles(original, model, s, x, out_weight=out_weight, head_dim=HEAD_DIM, mode=mode)


def assert_head_oracles(original: nn.Module, model: nn.Module, s: Surgeon, x: torch.Tensor, *, out_weight: str,
                        head_dim: int, mode: str) -> None:
    """``model``, installed by ``s``, computes what ``original`` does in both modes; in ``mode``, a clone of head 1
    leaves the outputs unchanged, and its removal (on a fresh copy) equals zeroing it through ``tap`` and zeroing
    its ``head_dim`` columns of ``out_weight`` on a copy of the original."""
    with torch.no_grad():
        for mode_now in ("train", "eval"):  # the installed graphs compute what the model does, in both modes
            getattr(model, mode_now)()
            getattr(original, mode_now)()
            assert _close(model(x), original(x), 1e-12)
        getattr(model, mode)()
        y0 = model(x)
        s.clone(_head(s), 1, noise_std=0.1, generator=torch.Generator().manual_seed(0), relative=True)
        assert _close(model(x), y0, 1e-9)

        removed = copy.deepcopy(original)
        s2 = Surgeon(removed, (x,))
        tap = s2.tap(_head(s2), _zeroing(1))
        by_tap = removed(x)
        tap.remove()
        s2.remove(_head(s2), 1)
        assert _close(removed(x), by_tap, 1e-9)
        masked = masked_copy(original, {out_weight: {1}}, {out_weight: head_dim})
        assert _close(removed(x), masked(x), 1e-9)


_NORM = ("weight", "bias", "running_mean", "running_var")
OWNED = {  # the per-head tensors each head owns besides q/k/v rows and output columns: name -> dim
    "batch_norm_module": {**{f"attn.{n}_norm.{t}": 0 for n in "qkv" for t in _NORM}, "attn.pos_bias.weight": 1},
    "batch_norm_captured": {**{f"attn.{n}_norm.{t}": 0 for n in "qkv" for t in _NORM}, "attn.pos_bias.weight": 1},
    "batch_norm_tokens": {f"attn.norm.{t}": 0 for t in _NORM},
    "cosine": {"attn.logit_scale": 0, "attn.position_mlp.2.weight": 0},
    "cosine_captured": {"attn.logit_scale": 0, "attn.position_mlp.2.weight": 0},
    "shifted_window_sdpa": {"attn.table": 1},
    "shifted_window_captured": {"attn.table": 1},
}


@pytest.mark.parametrize("name", list(OWNED))
def test_a_head_owns_its_norm_statistics_scales_and_bias_rows(name: str) -> None:
    model, x, _ = _built(name)
    s = Surgeon(model, (x,))
    sliced = {sl.name: sl.dim for sl in _head(s).slices}
    assert {k: sliced.get(k) for k in OWNED[name]} == OWNED[name], s.explain()
    assert not any("num_batches_tracked" in k for k in sliced)  # a count shared by all channels
    if name.startswith("cosine"):  # the bias MLP's hidden channels are a group of their own
        assert [g.module for g in s.groups if g.kind == "channel"] == ["attn.position_mlp"]


@pytest.mark.parametrize("name", ["locality_method", "batch_norm_tokens", "batch_norm_captured", "cosine_captured"])
def test_adam_state_follows_and_zero_heads_train(name: str) -> None:
    """Down to no heads, or to one where torch needs a channel (a convolution, a batch norm), which the group says."""
    model, x, out_weight = _built(name, "train")
    s = Surgeon(model, (x,))
    head = _head(s)
    normed = name.startswith("batch_norm")
    assert head.min_count == normed
    assert any(note.endswith(": a batch norm cannot have zero channels") for note in head.notes) == normed
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    s.attach_optimizer(opt)
    train_steps(model, opt, x)
    out = dict(model.named_parameters())[out_weight]
    before = opt.state[out]["exp_avg"].clone()
    s.remove(head, 0)
    assert torch.equal(opt.state[out]["exp_avg"], before[:, HEAD_DIM:])  # the kept columns' moments, bit-identical
    while head.count > head.min_count:
        s.remove(head, 0)
    for p in model.parameters():
        assert opt.state[p]["exp_avg"].shape == p.shape
    assert torch.isfinite(train_steps(model, opt, x))


def test_locality_temperature_is_shared_and_a_mask_along_the_heads_is_refused() -> None:
    model, x, _ = _built("locality_method")
    head = _head(Surgeon(model, (x,)))
    assert all("temperature" not in sl.name for sl in head.slices)  # one scalar for all heads: no member

    class PerHeadMask(LocalityAttention):
        def __init__(self):
            super().__init__()
            self.register_buffer("mask", torch.rand(HEADS, TOKENS, TOKENS) > 0.5)

        def attend(self, x: torch.Tensor) -> torch.Tensor:
            b, n, _ = x.shape
            q, k, v = self.qkv(x).reshape(b, n, 3, HEADS, HEAD_DIM).permute(2, 0, 3, 1, 4).unbind(0)
            dots = (q @ k.transpose(-1, -2)).masked_fill(self.mask, -1e4)
            return self.out((dots.softmax(-1) @ v).transpose(1, 2).reshape(b, n, INNER))

    with pytest.raises(AnalysisError, match=r"attn: masked_fill: the mask lines up with the unit axis \(dim 1\)"):
        Surgeon(Residual(PerHeadMask()).double(), (x,))


@pytest.mark.parametrize("name", ["batch_norm_module", "batch_norm_functional", "batch_norm_captured"])
def test_batch_norm_in_training_keeps_the_running_statistics_of_kept_units(name: str) -> None:
    """In training a batch norm normalises by the batch's statistics and moves its running ones: a removal equals
    masking there too, and the kept channels' running statistics move exactly as in the masked model."""
    model, x, out_weight = _built(name, "train")
    masked = copy.deepcopy(model)
    s = Surgeon(model, (x,))
    kept = masked.state_dict()
    assert all(torch.equal(t, kept[k]) for k, t in model.state_dict().items())  # the analysis moved no statistic
    attn, masked_attn = model.attn, masked.attn
    s.remove(_head(s), 0)
    with torch.no_grad():
        dict(masked.named_parameters())[out_weight][:, :HEAD_DIM] = 0
        assert _close(model(x), masked(x), 1e-9)
    assert attn.q_norm.num_features == INNER - HEAD_DIM and attn.q_norm.running_var.shape == (INNER - HEAD_DIM,)
    for norm, reference in ((attn.q_norm, masked_attn.q_norm), (attn.v_norm, masked_attn.v_norm)):
        assert torch.allclose(norm.running_mean, reference.running_mean[HEAD_DIM:], rtol=0, atol=1e-12)
        assert torch.allclose(norm.running_var, reference.running_var[HEAD_DIM:], rtol=0, atol=1e-12)
    assert torch.allclose(attn.out_norm.running_mean, masked_attn.out_norm.running_mean, rtol=0, atol=1e-12)


class FeedForward(nn.Module):
    def __init__(self, activation: Callable[[torch.Tensor], torch.Tensor]):
        super().__init__()
        self.activation, self.fc1, self.fc2 = activation, nn.Linear(DIM, 4), nn.Linear(4, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.activation(self.fc1(x)))


class BatchNormedFeedForward(nn.Module):
    """An FFN whose hidden channels are batch-normed (over the tokens); ``hidden`` of them."""

    def __init__(self, hidden: int):
        super().__init__()
        self.fc1, self.norm, self.fc2 = nn.Linear(DIM, hidden), nn.BatchNorm1d(hidden), nn.Linear(hidden, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.norm(self.fc1(x).transpose(1, 2)).transpose(1, 2)))


def test_a_batch_normed_ffn_of_one_channel_is_a_group_that_clones() -> None:
    """One channel is a channel group's minimum: the self-check does not remove it (batch norm has no zero-channel
    form), and the group is offered; a clone leaves the outputs unchanged."""
    torch.manual_seed(0)
    model = nn.Sequential(BatchNormedFeedForward(1), nn.Linear(DIM, 3)).double().eval()
    x = torch.randn(2, 5, DIM, dtype=torch.double)
    original = copy.deepcopy(model)
    s = Surgeon(model, (x,))
    (g,) = s.groups
    assert (g.kind, g.count, g.min_count) == ("channel", 1, 1)
    s.clone(g, 0, noise_std=0.5)
    with torch.no_grad():
        assert (model(x) - original(x)).abs().max() < 1e-9
    assert model[0].norm.running_mean.shape == (2,)


class SumNormalised(FeedForward):
    """``h / h.sum(-1, keepdim=True).expand_as(h)``: the sum spans the units, so it carries no ids, and neither does
    its expansion to the shape of ``h``, which does."""

    def __init__(self):
        super().__init__(F.softplus)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.activation(self.fc1(x))
        return x + self.fc2(h / h.sum(-1, keepdim=True).expand_as(h))


def test_an_expand_as_of_a_tensor_without_ids_is_analysed() -> None:
    """The normalised layer's channels are no group (removing one changes the others); the next layer's are."""
    model = nn.Sequential(nn.Linear(5, DIM), SumNormalised(), FeedForward(F.relu)).double()
    s = Surgeon(model, (_tokens(),))
    assert [(g.module, g.kind, g.exact) for g in s.groups] == [("2", "channel", True)]


def _broken_rule(step) -> None:
    raise RuntimeError("this rule is broken on purpose")


def test_a_failing_rule_is_a_refusal_naming_its_node() -> None:
    """A rule that raises refuses the units that reach its node, naming the node and the error; the rest of the
    model is analysed as before."""
    model = nn.Sequential(nn.Linear(5, DIM), FeedForward(F.gelu), FeedForward(F.relu)).double()
    with fxsurgery.register_rule(F.gelu, rule=_broken_rule, replace=True):
        analysis = fxsurgery.analyse(model, (_tokens(),))
    assert [g.module for g in analysis.groups] == ["2"]
    reasons = [r for lo in analysis.left_out for r in lo.reasons]
    assert "gelu: its rule failed: RuntimeError: this rule is broken on purpose" in reasons, reasons
    assert [g.module for g in fxsurgery.analyse(model, (_tokens(),)).groups] == ["1", "2"]  # the rule is back


def test_a_failing_rule_with_nothing_to_refuse_names_its_node() -> None:
    """A rule that starts ids (a graph input's) and fails leaves nothing to refuse but the graph: an
    ``AnalysisError`` naming the node and the error."""
    model = nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 3)).double()
    with fxsurgery.register_rule(nn.Linear, rule=_broken_rule, always=True, replace=True):
        with pytest.raises(AnalysisError, match=r"_0: its rule failed: RuntimeError: this rule is broken on purpose"):
            Surgeon(model, (_tokens(),))
