"""Tiny transformers of ``zoo``'s styles with two more patterns: heads mixed by learnable heads×heads maps (talking
heads before and after the softmax, re-attention after it; ``bhij,hg->bgij`` parameters or Linear layers over the
heads axis) and batch norm over the projections' unit channels (q/k/v, FFN hidden; module or ``F.batch_norm``).

Each model masks units in its own forward (``mask_units``: a removed unit's activations are zeroed at every point
they enter the others), and ``masked_weights`` zeroes what a unit writes into the others on a copy: two references
for a removal built from the model's layout, never from fxsurgery's slices.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from zoo import Attention, Block, Mlp, Style, TinyTransformer, masked_copy

MIXINGS = {"none": (), "pre_post": ("pre", "post"), "pre": ("pre",), "post": ("post",)}


@dataclass(frozen=True)
class MixedStyle(Style):
    mixing: str = "none"  # none | pre_post | pre | post: which of the logits and the weights are mixed over heads
    mixing_map: str = "einsum"  # einsum (a heads×heads parameter) | linear (nn.Linear over the heads axis)
    qkv_norm: str = "none"  # none | module | functional: batch norm over the q/k/v channels
    mlp_norm: str = "none"  # none | module | functional: batch norm over the FFN hidden channels


class ChannelNorm(nn.Module):
    """Batch norm over the channels of ``(B, N, C)`` tokens (the batch and the tokens are its samples), through the
    module or through ``F.batch_norm`` on its parameters and statistics; statistics and scales differ per channel."""

    def __init__(self, channels: int, how: str):
        super().__init__()
        self.how, self.norm = how, nn.BatchNorm1d(channels)
        with torch.no_grad():
            self.norm.weight.uniform_(0.5, 1.5)
            self.norm.bias.normal_()
            self.norm.running_mean.normal_()
            self.norm.running_var.uniform_(0.5, 2.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.transpose(1, 2)
        if self.how == "module":
            x = self.norm(x)
        else:
            bn = self.norm
            x = F.batch_norm(x, bn.running_mean, bn.running_var, bn.weight, bn.bias, self.training, bn.momentum,
                             bn.eps)
        return x.transpose(1, 2)


def _normed(linear: nn.Linear, how: str) -> nn.Module:
    return linear if how == "none" else nn.Sequential(linear, ChannelNorm(linear.out_features, how))


class MixedAttention(Attention):
    """``zoo.Attention``'s projections (batch-normed by ``qkv_norm``) with the heads mixed by ``pre`` (logits) and
    ``post`` (weights) maps; ``masked_units`` are heads zeroed where they enter the others (their values, which
    zero their outputs, and the mixing maps' inputs)."""

    def __init__(self, dim: int, s: MixedStyle):
        super().__init__(dim, s)
        for name in ("q", "k", "v") if s.projection == "separate" else ("qkv",):
            setattr(self, name, _normed(getattr(self, name), s.qkv_norm))
        for name in MIXINGS[s.mixing]:
            made = nn.Linear(s.heads, s.heads) if s.mixing_map == "linear" else nn.Parameter(
                torch.randn(s.heads, s.heads) / s.heads ** 0.5)
            setattr(self, name, made)
        self.masked_units: frozenset[int] = frozenset()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        q, k, v = self.project(x)
        v = self._masked(v)
        if self.s.product == "sdpa" and self.s.mixing == "none":
            o = F.scaled_dot_product_attention(q, k, v)
        else:
            if self.s.product == "einsum":
                a = torch.einsum("bhid,bhjd->bhij", q, k) * self.hd ** -0.5
            else:
                a = (q * self.hd ** -0.5) @ k.transpose(-2, -1)
            if "pre" in MIXINGS[self.s.mixing]:
                a = _mixed(self._masked(a), self.pre)
            a = a.softmax(dim=-1)
            if "post" in MIXINGS[self.s.mixing]:
                a = _mixed(self._masked(a), self.post)
            o = torch.einsum("bhij,bhjd->bhid", a, v) if self.s.product == "einsum" else a @ v
        return self.proj(_merged(o.transpose(1, 2), self.s.merge, C))

    def _masked(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (heads on dim 1) with the masked heads zeroed."""
        if not self.masked_units:
            return t
        keep = torch.ones(self.h, dtype=t.dtype)
        keep[list(self.masked_units)] = 0
        return t * keep.view(-1, *[1] * (t.dim() - 2))


def _mixed(t: torch.Tensor, m: nn.Parameter | nn.Linear) -> torch.Tensor:
    """The heads (dim 1) of ``t`` mixed by ``m``: ``m[read, made]``, or a Linear over the heads moved last."""
    if isinstance(m, nn.Linear):
        return m(t.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
    return torch.einsum("bhij,hg->bgij", t, m)


def _merged(o: torch.Tensor, merge: str, width: int) -> torch.Tensor:
    """``(B, N, heads, head_dim)`` to the projection's input, laid out as ``zoo.head_columns`` says."""
    B, N = o.shape[:2]
    if merge == "flatten":
        return o.flatten(2)
    if merge == "head_minor":
        return o.transpose(-2, -1).reshape(B, N, -1)
    return o.reshape(B, N, width) if merge == "reshape_c" else o.reshape(B, N, -1)


class MixedMlp(Mlp):
    """``zoo.Mlp`` with batch norm over the hidden channels before the activation (``mlp_norm``);
    ``masked_units`` are hidden channels zeroed before ``fc2``."""

    def __init__(self, dim: int, s: MixedStyle):
        super().__init__(dim, s)
        self.fc1 = _normed(self.fc1, s.mlp_norm)
        self.masked_units: frozenset[int] = frozenset()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.fc1(x))
        if self.masked_units:
            keep = torch.ones(h.shape[-1], dtype=h.dtype)
            keep[list(self.masked_units)] = 0
            h = h * keep
        return self.fc2(h)


class MixedBlock(Block):
    def __init__(self, dim: int, s: MixedStyle):
        super().__init__(dim, s)
        self.attn, self.mlp = MixedAttention(dim, s), MixedMlp(dim, s)


class MixedTransformer(TinyTransformer):
    """``zoo.TinyTransformer`` of mixed blocks; ``UNIT_COLUMNS`` as there (the mixing changes no output layout)."""

    def __init__(self, s: MixedStyle, in_dim: int = 5, classes: int = 3):
        super().__init__(s, in_dim=in_dim, classes=classes)
        self.blocks = nn.ModuleList(MixedBlock(self.embed.out_features, s) for _ in range(s.depth))


def unit_module(output_weight: str) -> str:
    """The attention or FFN module whose units an output weight (``blocks.0.attn.proj.weight``) reads."""
    return output_weight.rsplit(".", 2)[0]


def mask_units(model: MixedTransformer, dead: dict[str, set[int]]) -> None:
    """Mask the ``dead`` units (by output weight, as ``UNIT_COLUMNS`` names them) in the model's own forward."""
    for name, units in dead.items():
        model.get_submodule(unit_module(name)).masked_units = frozenset(units)


def masked_weights(model: MixedTransformer, dead: dict[str, set[int]]) -> nn.Module:
    """A copy whose weights mask the ``dead`` units: their output columns and the rows of the mixing maps through
    which they reach the other heads are zero."""
    ref = masked_copy(model, dead)
    with torch.no_grad():
        for name, units in dead.items():
            module = ref.get_submodule(unit_module(name))
            module.masked_units = frozenset()  # a copy of a model masked in its forward masks by its weights only
            for map_name in MIXINGS[module.s.mixing] if isinstance(module, MixedAttention) and units else ():
                m = getattr(module, map_name)
                if isinstance(m, nn.Linear):
                    m.weight[:, list(units)] = 0
                else:
                    m[list(units)] = 0
    return ref


def norm_channels(s: MixedStyle, block: int, heads: list[int], hidden: list[int]) -> dict[str, list[int]]:
    """The channels of each batch norm of block ``block`` that its ``heads`` and ``hidden`` units own, by the norm's
    name: the heads' q/k/v channels as the projection lays them out, and the FFN's hidden channels."""
    hd, inner, at = s.head_dim, s.heads * s.head_dim, f"blocks.{block}"
    per_head = [c for h in heads for c in range(h * hd, (h + 1) * hd)]
    out = {}
    if s.qkv_norm != "none" and s.projection == "separate":
        out.update({f"{at}.attn.{name}.1.norm": per_head for name in "qkv"})
    elif s.qkv_norm != "none" and s.projection == "head_major":  # [head][q|k|v][head_dim]
        out[f"{at}.attn.qkv.1.norm"] = [c for h in heads for c in range(3 * h * hd, 3 * (h + 1) * hd)]
    elif s.qkv_norm != "none":  # [q|k|v][head][head_dim]
        out[f"{at}.attn.qkv.1.norm"] = [part * inner + c for part in range(3) for c in per_head]
    if s.mlp_norm != "none":
        out[f"{at}.mlp.fc1.1.norm"] = list(hidden)
    return out
