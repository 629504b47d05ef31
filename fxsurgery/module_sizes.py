"""Keeping torch.nn modules' size attributes (read by their repr and forward) truthful after an edit:
one small function per module family, chosen by type."""
from __future__ import annotations

from typing import Callable

import torch.nn as nn

from .compat import ConvNd, NormBase


def _sync_linear(mod: nn.Linear, pname: str) -> None:
    if pname == "weight":
        mod.out_features, mod.in_features = mod.weight.shape


def _sync_norm(mod: nn.LayerNorm | nn.RMSNorm, pname: str) -> None:
    if pname == "weight":
        mod.normalized_shape = tuple(mod.weight.shape[-len(mod.normalized_shape):])


def _sync_batch_norm(mod: NormBase, pname: str) -> None:
    mod.num_features = getattr(mod, pname).shape[0]


def _sync_conv(mod: ConvNd, pname: str) -> None:
    """A depthwise convolution (one group per input channel, each making ``multiplier`` outputs) stays
    depthwise with its multiplier; others keep their groups. A transposed one stores its weight [in, out / groups]."""
    if pname == "weight" and mod.transposed:
        rows, per_group = mod.weight.shape[:2]
        if mod.groups == mod.in_channels:
            mod.groups = rows
        mod.in_channels, mod.out_channels = rows, per_group * mod.groups
    elif pname == "weight":
        out, per_group = mod.weight.shape[:2]
        if mod.groups == mod.in_channels and per_group == 1 and mod.out_channels % mod.in_channels == 0:
            mod.groups = out // (mod.out_channels // mod.in_channels)
        mod.out_channels, mod.in_channels = out, per_group * mod.groups


def _sync_attention(mod: nn.MultiheadAttention, pname: str) -> None:
    """The head count follows the query rows; ``embed_dim`` stays the model width, so the module's own
    forward no longer applies: its host runs the decomposed graph."""
    if pname in ("in_proj_weight", "q_proj_weight"):
        rows = getattr(mod, pname).shape[0] // (3 if pname == "in_proj_weight" else 1)
        mod.num_heads = rows // mod.head_dim


_SIZE_SYNC: list[tuple[type | tuple[type, ...], Callable[[nn.Module, str], None]]] = [
    (nn.Linear, _sync_linear),
    ((nn.LayerNorm, nn.RMSNorm), _sync_norm),
    (NormBase, _sync_batch_norm),
    (ConvNd, _sync_conv),
    (nn.MultiheadAttention, _sync_attention),
]


def sync_sizes(module: nn.Module | None, pname: str) -> None:
    """Update ``module``'s size attributes after its tensor ``pname`` was resized."""
    sync = next((fn for types, fn in _SIZE_SYNC if isinstance(module, types)), None)
    if sync is not None:
        sync(module, pname)
