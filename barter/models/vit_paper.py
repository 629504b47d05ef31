"""The paper's small ViT for 64-px images (patch 8, dim 192, depth 9, 12 heads, MLP ratio 2), as a timm model.

It is timm's ``VisionTransformer`` with that configuration (class token, learnable positional embedding,
pre-norm blocks, stochastic depth rising linearly to 0.1, no dropout). The qkv projection has no bias by
default (our choice: the configuration is the ViT baseline of Lee et al. 2021, "Vision Transformer for
Small-Size Datasets", whose attention has no qkv bias); pass ``qkv_bias=True`` for timm's default.
"""

from typing import Any

from timm.models import generate_default_cfgs, register_model
from timm.models.vision_transformer import VisionTransformer

from .build import build

TINY_IMAGENET_MEAN = (0.4802, 0.4481, 0.3975)
TINY_IMAGENET_STD = (0.2302, 0.2265, 0.2262)


def _cfg(img_size: int, num_classes: int) -> dict[str, Any]:
    return {
        "url": "", "num_classes": num_classes, "input_size": (3, img_size, img_size), "pool_size": None,
        "crop_pct": 1.0, "interpolation": "bicubic", "mean": TINY_IMAGENET_MEAN, "std": TINY_IMAGENET_STD,
        "first_conv": "patch_embed.proj", "classifier": "head",
    }


default_cfgs = generate_default_cfgs({
    "vit_paper_p8_64": _cfg(64, 200),
    "vit_paper_p8_64_tiny": _cfg(64, 10),
})


def _create_vit(variant: str, pretrained: bool = False, **kwargs: Any) -> VisionTransformer:
    return build(VisionTransformer, variant, pretrained, **kwargs)


def _defaults(**arch: Any) -> dict[str, Any]:
    return dict(
        img_size=64, patch_size=8, mlp_ratio=2.0, qkv_bias=False, drop_path_rate=0.1,
        drop_rate=0.0, proj_drop_rate=0.0, attn_drop_rate=0.0, **arch,
    )


@register_model
def vit_paper_p8_64(pretrained: bool = False, **kwargs: Any) -> VisionTransformer:
    """The paper's ViT: 64-px input, patch 8 (64 tokens + class token), dim 192, depth 9, 12 heads."""
    args = _defaults(embed_dim=192, depth=9, num_heads=12)
    return _create_vit("vit_paper_p8_64", pretrained, **dict(args, **kwargs))


@register_model
def vit_paper_p8_64_tiny(pretrained: bool = False, **kwargs: Any) -> VisionTransformer:
    """Tiny variant for tests: same tokenisation, dim 48, depth 2, 3 heads."""
    args = _defaults(embed_dim=48, depth=2, num_heads=3)
    return _create_vit("vit_paper_p8_64_tiny", pretrained, **dict(args, **kwargs))
