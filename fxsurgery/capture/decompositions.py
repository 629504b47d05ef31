"""torch.nn modules traced through plain ops instead of kept as opaque leaves.

``nn.MultiheadAttention`` checks ``embed_dim == num_heads * head_dim`` in its forward, so a layer with fewer
heads could not run it; ``nn.TransformerEncoder`` and its layer branch on tensor properties (the fused
inference path, nested tensors, mask dtypes) that symbolic tracing cannot follow. Each is traced through a
function with the module's signature and the arithmetic of its training path, in ops the labelling has
rules for; the heads it holds are then found like any others. These are torch's own building blocks, as
``nn.Linear`` is, not architectures.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F

from ..compat import feed_forward_block, self_attention_block
from ..errors import TraceError

DECOMPOSITIONS: dict[type, Callable[..., Any]] = {}
# Modules whose units are hosted by their caller's graph: callers pass one tensor as query, key and value
# (one fused projection) and drop the attention weights (not computed), which only the caller's graph shows.
CALLER_HOSTED: set[type] = set()


class NoDecomposition(TraceError):
    """A torch module used in a way its decomposition does not cover: a refusal, not a tracing failure, so no
    other front end is tried (it would lose the reason)."""


def decomposes(cls: type, caller_hosted: bool = False) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        DECOMPOSITIONS[cls] = fn
        if caller_hosted:
            CALLER_HOSTED.add(cls)
        return fn
    return deco


def additive_mask(attn_mask: torch.Tensor | None, key_padding_mask: torch.Tensor | None, batch: int,
                  dtype: torch.dtype) -> torch.Tensor:
    """``nn.MultiheadAttention``'s masks (bool: True = masked out; float: added) as one float mask that
    broadcasts to the (B, H, L, S) scores. A 3-D ``attn_mask`` is read as (B·H, L, S)."""
    out = None
    for mask, padding in ((attn_mask, False), (key_padding_mask, True)):
        if mask is None:
            continue
        if mask.dtype == torch.bool:
            mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask, float("-inf"))
        mask = mask.to(dtype)
        if padding:
            mask = mask.reshape(batch, 1, 1, -1)
        elif mask.dim() == 2:
            mask = mask.reshape(1, 1, *mask.shape)
        else:
            mask = mask.reshape(batch, -1, *mask.shape[-2:])
        out = mask if out is None else out + mask
    return out


torch.fx.wrap("additive_mask")  # a graph node of its own: masks carry no units, their dtype is read at run time


@decomposes(nn.MultiheadAttention, caller_hosted=True)
def multihead_attention(self: nn.MultiheadAttention, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        key_padding_mask: torch.Tensor | None = None, need_weights: bool = True,
                        attn_mask: torch.Tensor | None = None, average_attn_weights: bool = True,
                        is_causal: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Batched inputs; the head count is whatever ``in_proj_weight`` (or ``q_proj_weight``) holds."""
    if self.bias_k is not None or self.add_zero_attn:
        raise NoDecomposition("nn.MultiheadAttention with add_bias_kv or add_zero_attn has no decomposition")
    if is_causal and attn_mask is None:
        raise NoDecomposition("nn.MultiheadAttention: is_causal needs attn_mask")
    shared = query is key and key is value
    shared_kv = key is value and not shared  # cross-attention: torch projects key and value in one product
    if self.batch_first:  # computed sequence-first as torch does, so outputs have its memory layout
        query = query.transpose(0, 1)
        key, value = (query, query) if shared else (key.transpose(0, 1), value.transpose(0, 1))
        value = key if shared_kv else value
    length, batch, source = query.shape[0], query.shape[1], key.shape[0]
    heads, head_dim = self.num_heads, self.head_dim
    packed = self.in_proj_weight is not None  # query, key and value weights in one parameter
    if shared and packed:
        qkv = F.linear(query, self.in_proj_weight, self.in_proj_bias).reshape(length, batch, 3, heads, head_dim)
        q, k, v = qkv.permute(2, 1, 3, 0, 4).unbind(0)
    elif shared_kv and packed:  # thirds, not sizes: nothing here depends on the head count
        w_q, w_k, w_v = self.in_proj_weight.chunk(3)
        w_kv = torch.cat([w_k, w_v])
        b_q, b_kv = None, None
        if self.in_proj_bias is not None:
            b_q, b_k, b_v = self.in_proj_bias.chunk(3)
            b_kv = torch.cat([b_k, b_v])
        q = F.linear(query, w_q, b_q).reshape(length, batch, heads, head_dim).permute(1, 2, 0, 3)
        kv = F.linear(key, w_kv, b_kv).reshape(source, batch, 2, heads, head_dim)
        k, v = kv.permute(2, 1, 3, 0, 4).unbind(0)
    else:
        if packed:
            w = self.in_proj_weight.chunk(3)
            weights = (w[0], w[1], w[2])
        else:
            weights = (self.q_proj_weight, self.k_proj_weight, self.v_proj_weight)
        b = self.in_proj_bias.chunk(3) if self.in_proj_bias is not None else (None, None, None)
        q = F.linear(query, weights[0], b[0]).reshape(length, batch, heads, head_dim).permute(1, 2, 0, 3)
        k = F.linear(key, weights[1], b[1]).reshape(source, batch, heads, head_dim).permute(1, 2, 0, 3)
        v = F.linear(value, weights[2], b[2]).reshape(source, batch, heads, head_dim).permute(1, 2, 0, 3)
    causal_hint = is_causal and key_padding_mask is None and not need_weights
    mask = None
    if not causal_hint and (attn_mask is not None or key_padding_mask is not None):
        mask = additive_mask(attn_mask, key_padding_mask, batch, query.dtype)
    p = self.dropout if self.training else 0.0
    if need_weights:
        scores = (q * math.sqrt(1.0 / head_dim)) @ k.transpose(-2, -1)
        attn = (scores if mask is None else scores + mask).softmax(dim=-1)
        out = (F.dropout(attn, p=p) if p > 0 else attn) @ v
    else:
        attn = None
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=causal_hint)
    out = self.out_proj(out.permute(2, 0, 1, 3).reshape(length, batch, heads * head_dim))
    if self.batch_first:
        out = out.transpose(0, 1)
    if attn is not None and average_attn_weights:
        attn = attn.mean(dim=1)
    return out, attn


@decomposes(nn.TransformerEncoderLayer)
def transformer_encoder_layer(self: nn.TransformerEncoderLayer, src: torch.Tensor,
                              src_mask: torch.Tensor | None = None, src_key_padding_mask: torch.Tensor | None = None,
                              is_causal: bool = False) -> torch.Tensor:
    """The layer without its fused inference path (the same function)."""
    x = src
    if self.norm_first:
        x = x + self_attention_block(self, self.norm1(x), src_mask, src_key_padding_mask, is_causal)
        return x + feed_forward_block(self, self.norm2(x))
    x = self.norm1(x + self_attention_block(self, x, src_mask, src_key_padding_mask, is_causal))
    return self.norm2(x + feed_forward_block(self, x))


@decomposes(nn.TransformerEncoder)
def transformer_encoder(self: nn.TransformerEncoder, src: torch.Tensor, mask: torch.Tensor | None = None,
                        src_key_padding_mask: torch.Tensor | None = None,
                        is_causal: bool | None = None) -> torch.Tensor:
    """The layers in turn (no nested-tensor path: padded positions keep their values instead of zeros). A
    mask not declared causal is applied as given, which is the same function as the causal hint."""
    for layer in self.layers:
        src = layer(src, src_mask=mask, src_key_padding_mask=src_key_padding_mask, is_causal=bool(is_causal))
    return self.norm(src) if self.norm is not None else src


@decomposes(nn.TransformerDecoder)
def transformer_decoder(self: nn.TransformerDecoder, tgt: torch.Tensor, memory: torch.Tensor,
                        tgt_mask: torch.Tensor | None = None, memory_mask: torch.Tensor | None = None,
                        tgt_key_padding_mask: torch.Tensor | None = None,
                        memory_key_padding_mask: torch.Tensor | None = None, tgt_is_causal: bool | None = None,
                        memory_is_causal: bool = False) -> torch.Tensor:
    """The layers in turn."""
    for layer in self.layers:
        tgt = layer(tgt, memory, tgt_mask=tgt_mask, memory_mask=memory_mask, tgt_key_padding_mask=tgt_key_padding_mask,
                    memory_key_padding_mask=memory_key_padding_mask, tgt_is_causal=bool(tgt_is_causal),
                    memory_is_causal=memory_is_causal)
    return self.norm(tgt) if self.norm is not None else tgt
