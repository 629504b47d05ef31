"""Tiny hand-written transformers in the styles people write them, for fxsurgery's property tests.

Every style choice is independent: projection layout, how q/k/v are split, the attention product,
how heads are merged back, the FFN activation. ``UNIT_COLUMNS`` (``HEAD_OUT``/``FFN_OUT`` for the
convolutional model) name the output weights and the columns each unit owns, taken from how the model
is built, so a test can build the masked reference of a removal without knowing anything about fxsurgery.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class Style:
    heads: int = 2
    head_dim: int = 4
    mlp_hidden: int = 6
    depth: int = 2
    projection: str = "fused"  # fused | fused_chunk | fused_split | head_major | separate
    product: str = "sdpa"  # sdpa | matmul | einsum
    merge: str = "reshape_minus1"  # reshape_minus1 | flatten | reshape_c | head_minor
    activation: str = "gelu"  # gelu | relu | silu | tanh
    qkv_bias: bool = True
    attn_drop: float = 0.0
    drop_path: float = 0.0


class Attention(nn.Module):
    def __init__(self, dim: int, s: Style):
        super().__init__()
        self.s, self.h, self.hd = s, s.heads, s.head_dim
        inner = s.heads * s.head_dim
        if s.projection == "separate":
            self.q = nn.Linear(dim, inner, bias=s.qkv_bias)
            self.k = nn.Linear(dim, inner, bias=s.qkv_bias)
            self.v = nn.Linear(dim, inner, bias=s.qkv_bias)
        else:
            self.qkv = nn.Linear(dim, 3 * inner, bias=s.qkv_bias)
        self.drop = nn.Dropout(s.attn_drop)
        self.proj = nn.Linear(inner, dim)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        B, N, C = x.shape
        p = self.s.projection
        if p == "separate":
            return tuple(lin(x).view(B, N, self.h, self.hd).transpose(1, 2) for lin in (self.q, self.k, self.v))
        if p == "fused":
            qkv = self.qkv(x).reshape(B, N, 3, self.h, self.hd).permute(2, 0, 3, 1, 4)
            return qkv.unbind(0)
        if p == "head_major":
            qkv = self.qkv(x).reshape(B, N, self.h, 3, self.hd).permute(3, 0, 2, 1, 4)
            return qkv[0], qkv[1], qkv[2]
        if p == "fused_chunk":
            parts = self.qkv(x).chunk(3, dim=-1)
        else:
            parts = torch.split(self.qkv(x), [self.h * self.hd] * 3, dim=-1)
        return tuple(parts[i].reshape(B, N, self.h, self.hd).transpose(1, 2) for i in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        q, k, v = self.project(x)
        if self.s.product == "sdpa":
            o = F.scaled_dot_product_attention(q, k, v, dropout_p=self.s.attn_drop if self.training else 0.0)
        else:
            if self.s.product == "matmul":
                a = (q * self.hd ** -0.5) @ k.transpose(-2, -1)
            else:
                a = torch.einsum("bhid,bhjd->bhij", q, k) * self.hd ** -0.5
            a = self.drop(a.softmax(dim=-1))
            o = a @ v if self.s.product == "matmul" else torch.einsum("bhij,bhjd->bhid", a, v)
        o = o.transpose(1, 2)
        if self.s.merge == "flatten":
            o = o.flatten(2)
        elif self.s.merge == "head_minor":  # features laid out [head_dim][head]
            o = o.transpose(-2, -1).reshape(B, N, -1)
        elif self.s.merge == "reshape_c":
            o = o.reshape(B, N, C)
        else:
            o = o.reshape(B, N, -1)
        return self.proj(o)


class Mlp(nn.Module):
    def __init__(self, dim: int, s: Style):
        super().__init__()
        self.fc1 = nn.Linear(dim, s.mlp_hidden)
        self.act = {"gelu": nn.GELU(), "relu": nn.ReLU(), "silu": nn.SiLU(), "tanh": nn.Tanh()}[s.activation]
        self.fc2 = nn.Linear(s.mlp_hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def drop_path(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    if p == 0.0 or not training:
        return x
    keep = x.new_empty(x.shape[0], 1, 1).bernoulli_(1 - p)
    return x * keep / (1 - p)


class Block(nn.Module):
    def __init__(self, dim: int, s: Style):
        super().__init__()
        self.s = s
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn, self.mlp = Attention(dim, s), Mlp(dim, s)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + drop_path(self.attn(self.norm1(x)), self.s.drop_path, self.training)
        return x + drop_path(self.mlp(self.norm2(x)), self.s.drop_path, self.training)


def head_columns(s: Style, h: int) -> list[int]:
    """The output-projection columns head ``h`` writes: ``[head][head_dim]`` features, or
    ``[head_dim][head]`` under the head-minor merge."""
    if s.merge == "head_minor":
        return [j * s.heads + h for j in range(s.head_dim)]
    return list(range(h * s.head_dim, (h + 1) * s.head_dim))


class TinyTransformer(nn.Module):
    """Tokens in, class logits out: (B, N, in_dim) -> (B, classes)."""

    def __init__(self, s: Style, in_dim: int = 5, classes: int = 3):
        super().__init__()
        dim = s.heads * s.head_dim if s.merge == "reshape_c" else 8
        self.embed = nn.Linear(in_dim, dim)
        self.blocks = nn.ModuleList(Block(dim, s) for _ in range(s.depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)
        self.UNIT_COLUMNS = {}  # output weight -> the columns of each unit, as the forward lays them out
        for i in range(s.depth):
            self.UNIT_COLUMNS[f"blocks.{i}.attn.proj.weight"] = [head_columns(s, h) for h in range(s.heads)]
            self.UNIT_COLUMNS[f"blocks.{i}.mlp.fc2.weight"] = [[c] for c in range(s.mlp_hidden)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x).mean(1))


class ConvAttention(nn.Module):
    """Attention on a (B, C, H, W) map with pointwise-convolution projections and BatchNorm on q/k/v."""

    def __init__(self, dim: int, heads: int, head_dim: int):
        super().__init__()
        self.h, self.hd = heads, head_dim
        self.qkv = nn.Conv2d(dim, 3 * heads * head_dim, 1, bias=False)
        self.bn = nn.BatchNorm2d(3 * heads * head_dim)
        self.proj = nn.Conv2d(heads * head_dim, dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, C, H, W = x.shape
        q, k, v = self.bn(self.qkv(x)).view(B, self.h, 3 * self.hd, H * W).split(self.hd, dim=2)
        a = (q.transpose(-2, -1) @ k * self.hd ** -0.5).softmax(dim=-1)
        return self.proj((v @ a.transpose(-2, -1)).view(B, -1, H, W))


class ConvMlp(nn.Module):
    """Pointwise fc1, a depthwise 3x3 convolution over the hidden channels, activation, pointwise fc2."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Conv2d(dim, hidden, 1)
        self.dw = nn.Conv2d(hidden, hidden, 3, padding=1, groups=hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Conv2d(hidden, dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.dw(self.fc1(x))))


class ConvTransformer(nn.Module):
    """Channels-first transformer: (B, in_chans, H, W) -> (B, classes); blocks read and write a map."""

    def __init__(self, heads: int = 3, head_dim: int = 4, hidden: int = 5, depth: int = 2, dim: int = 8,
                 in_chans: int = 3, classes: int = 3):
        super().__init__()
        self.embed = nn.Conv2d(in_chans, dim, 2, stride=2)
        self.attns = nn.ModuleList(ConvAttention(dim, heads, head_dim) for _ in range(depth))
        self.mlps = nn.ModuleList(ConvMlp(dim, hidden) for _ in range(depth))
        self.head = nn.Linear(dim, classes)
        self.HEAD_OUT = [(f"attns.{i}.proj.weight", head_dim) for i in range(depth)]
        self.FFN_OUT = [f"mlps.{i}.fc2.weight" for i in range(depth)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for attn, mlp in zip(self.attns, self.mlps):
            x = x + attn(x)
            x = x + mlp(x)
        return self.head(x.mean((2, 3)))


def masked_copy(model: nn.Module, dead: dict[str, set[int]], width: dict[str, int] | None = None) -> nn.Module:
    """Deep copy of ``model`` with the output-weight columns of the ``dead`` units zeroed: the columns
    ``model.UNIT_COLUMNS`` gives each unit, or runs of ``width[name]`` columns where ``width`` is given."""
    import copy

    ref = copy.deepcopy(model)
    params = dict(ref.named_parameters())
    with torch.no_grad():
        for name, units in dead.items():
            for u in units:
                cols = model.UNIT_COLUMNS[name][u] if width is None else range(u * width[name], (u + 1) * width[name])
                params[name][:, list(cols)] = 0
    return ref


def masked_outputs(model: nn.Module, x: torch.Tensor, weight: str, unit: int, width: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``model``'s output on ``x``, and that of a copy with ``unit``'s run of ``width`` columns of ``weight`` zeroed
    (the weights' oracle of removing it)."""
    with torch.no_grad():
        return model(x), masked_copy(model, {weight: {unit}}, width={weight: width})(x)


def assert_removal_masks_and_clone_keeps(surgeon, group, unit: int, run, *, by_weights: torch.Tensor,
                                         reference: torch.Tensor, tol: float = 1e-10) -> torch.Tensor:
    """Removing ``unit`` of ``group`` (a head group: the tap sees ``[..., heads, head_dim]``) equals ``by_weights``
    (the model with its output columns zeroed) and equals zeroing it at the tap, and changes ``reference``; a clone
    of unit 0 afterwards keeps the outputs. ``run()``: the model's output now. Returns the output after the removal."""
    handle = surgeon.tap(group, lambda a: a.select(-2, unit).zero_())
    with torch.no_grad():
        tapped = run()
    handle.remove()
    surgeon.remove(group, unit)
    with torch.no_grad():
        removed = run()
    assert (removed - by_weights).abs().max() < tol and (removed - tapped).abs().max() < tol
    assert not torch.allclose(removed, reference, atol=1e-6)
    surgeon.clone(group, 0, noise_std=0.1)
    with torch.no_grad():
        assert (run() - removed).abs().max() < tol
    return removed


def train_steps(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, steps: int = 2) -> torch.Tensor:
    """A few optimizer steps on a toy loss, so optimizer state exists; returns the last loss."""
    for _ in range(steps):
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
    return loss
