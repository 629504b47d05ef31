"""Compact Convolutional Transformer (CCT, Hassani et al. 2021), official CCT-7/3x1 layout, on timm layers.

The architecture follows the official SHI-Labs implementation: a one-layer convolutional tokenizer
(3x3 conv, stride 1, padding 1, no bias, ReLU, 3/2/1 max-pool), a learnable positional embedding,
encoder layers whose residual stream is layer-normalised after the attention residual (the official
layer's ``norm1``, here ``norm2``), a final LayerNorm and sequence pooling (a learned softmax weighting
of the tokens) before the classifier. Blocks are built from ``timm.layers.Attention`` (qkv without bias),
``timm.layers.Mlp`` and ``timm.layers.DropPath`` so that they are torch.fx-traceable and use the
module names timm models use (``blocks.i.attn.qkv``, ``blocks.i.mlp.fc1``, ...).
"""

from typing import Any

import torch
import torch.nn.functional as F
from timm.layers import Attention, DropPath, Mlp, trunc_normal_
from timm.models import generate_default_cfgs, register_model
from torch import nn

from .build import build

__all__ = ["CCT", "ConvTokenizer", "CCTBlock"]

CIFAR100_MEAN = (0.5071, 0.4865, 0.4409)
CIFAR100_STD = (0.2673, 0.2564, 0.2762)


class ConvTokenizer(nn.Module):
    """Turns an image into tokens: conv (no bias) -> ReLU -> max-pool, flattened to (B, N, C)."""

    def __init__(self, in_chans: int, embed_dim: int, kernel_size: int = 3) -> None:
        super().__init__()
        self.conv = nn.Conv2d(
            in_chans, embed_dim, kernel_size, stride=max(1, kernel_size // 2 - 1),
            padding=max(1, kernel_size // 2), bias=False,
        )
        self.act = nn.ReLU()
        self.pool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(self.act(self.conv(x))).flatten(2).transpose(1, 2)

    def num_tokens(self, in_chans: int, img_size: int) -> int:
        """Sequence length for a square ``img_size`` input (computed by a dry run, as the official code)."""
        with torch.no_grad():
            return self.forward(torch.zeros(1, in_chans, img_size, img_size)).shape[1]


class CCTBlock(nn.Module):
    """Official CCT encoder layer: x + attn(LN(x)), then LN, then + MLP (the residual stream is re-normalised)."""

    def __init__(
        self, dim: int, num_heads: int, mlp_ratio: float, attn_drop: float, drop_path: float,
    ) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, num_heads=num_heads, qkv_bias=False, attn_drop=attn_drop)
        self.drop_path1 = DropPath(drop_path) if drop_path > 0.0 else nn.Identity()
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, hidden_features=int(dim * mlp_ratio), act_layer=nn.GELU)
        self.drop_path2 = DropPath(drop_path) if drop_path > 0.0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop_path1(self.attn(self.norm1(x)))
        x = self.norm2(x)
        return x + self.drop_path2(self.mlp(x))


class CCT(nn.Module):
    """Compact Convolutional Transformer with sequence pooling and a timm-style model interface."""

    def __init__(
        self,
        img_size: int = 32,
        in_chans: int = 3,
        num_classes: int = 100,
        embed_dim: int = 256,
        depth: int = 7,
        num_heads: int = 4,
        mlp_ratio: float = 2.0,
        kernel_size: int = 3,
        attn_drop_rate: float = 0.1,
        drop_path_rate: float = 0.1,
        global_pool: str = "seq",
    ) -> None:
        super().__init__()
        if global_pool != "seq":
            raise ValueError(f"CCT only supports sequence pooling (global_pool='seq'), got {global_pool!r}")
        self.num_classes = num_classes
        self.num_features = self.head_hidden_size = self.embed_dim = embed_dim
        self.global_pool = global_pool
        self.tokenizer = ConvTokenizer(in_chans, embed_dim, kernel_size)
        self.pos_embed = nn.Parameter(torch.zeros(1, self.tokenizer.num_tokens(in_chans, img_size), embed_dim))
        drop_path_rates = torch.linspace(0, drop_path_rate, depth, device="cpu").tolist()  # also built on meta
        self.blocks = nn.Sequential(*[
            CCTBlock(embed_dim, num_heads, mlp_ratio, attn_drop_rate, dpr) for dpr in drop_path_rates
        ])
        self.norm = nn.LayerNorm(embed_dim)
        self.attention_pool = nn.Linear(embed_dim, 1)
        self.head = nn.Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()
        self._init_weights()

    def _init_weights(self) -> None:
        """Official initialisation: trunc-normal(0.02) linears, unit LayerNorms, Kaiming conv, pos-embed std 0.2."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight)
        trunc_normal_(self.pos_embed, std=0.2)

    def get_classifier(self) -> nn.Module:
        return self.head

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        """Replace the classifier by a freshly initialised one with ``num_classes`` outputs (0: identity)."""
        if global_pool not in (None, "seq"):
            raise ValueError(f"CCT only supports sequence pooling (global_pool='seq'), got {global_pool!r}")
        self.num_classes = num_classes
        self.head = nn.Linear(self.embed_dim, num_classes) if num_classes > 0 else nn.Identity()
        if isinstance(self.head, nn.Linear):
            trunc_normal_(self.head.weight, std=0.02)
            nn.init.zeros_(self.head.bias)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Image (B, C, H, W) -> normalised tokens (B, N, D)."""
        x = self.tokenizer(x) + self.pos_embed
        return self.norm(self.blocks(x))

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """Sequence pooling of the tokens, then the classifier unless ``pre_logits``."""
        weights = F.softmax(self.attention_pool(x), dim=1)
        x = torch.matmul(weights.transpose(-1, -2), x).squeeze(-2)
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))


def _cfg(img_size: int, num_classes: int, **kwargs: Any) -> dict[str, Any]:
    return {
        "url": "", "num_classes": num_classes, "input_size": (3, img_size, img_size), "pool_size": None,
        "crop_pct": 1.0, "interpolation": "bicubic", "mean": CIFAR100_MEAN, "std": CIFAR100_STD,
        "first_conv": "tokenizer.conv", "classifier": "head", **kwargs,
    }


default_cfgs = generate_default_cfgs({
    "cct_7_3x1_32": _cfg(32, 100),
    "cct_2_3x1_32_tiny": _cfg(32, 10),
})


def _create_cct(variant: str, pretrained: bool = False, **kwargs: Any) -> CCT:
    return build(CCT, variant, pretrained, **kwargs)


@register_model
def cct_7_3x1_32(pretrained: bool = False, **kwargs: Any) -> CCT:
    """Official CCT-7/3x1 for 32-px images: 7 layers, 4 heads, dim 256, MLP ratio 2."""
    args = dict(img_size=32, embed_dim=256, depth=7, num_heads=4, mlp_ratio=2.0)
    return _create_cct("cct_7_3x1_32", pretrained, **dict(args, **kwargs))


@register_model
def cct_2_3x1_32_tiny(pretrained: bool = False, **kwargs: Any) -> CCT:
    """Tiny CCT for tests: 2 layers, 2 heads, dim 64, MLP ratio 2, 32-px images."""
    args = dict(img_size=32, embed_dim=64, depth=2, num_heads=2, mlp_ratio=2.0)
    return _create_cct("cct_2_3x1_32_tiny", pretrained, **dict(args, **kwargs))
