"""Building the project's models through timm, so each carries a ``pretrained_cfg`` whose
``input_size`` and ``num_classes`` follow the constructor arguments (no weights are published)."""
from __future__ import annotations

from typing import Any

from timm.models import build_model_with_cfg
from torch import nn


def build(model_cls: type[nn.Module], variant: str, pretrained: bool = False, **kwargs: Any) -> nn.Module:
    overlay = dict(kwargs.pop("pretrained_cfg_overlay", None) or {})
    if pretrained and "file" not in overlay:
        raise ValueError(f"{variant}: no pretrained weights are published for this project's models (local ones "
                         "load with pretrained_cfg_overlay=dict(file=...))")
    overlay.setdefault("input_size", (kwargs.get("in_chans", 3), kwargs["img_size"], kwargs["img_size"]))
    if "num_classes" in kwargs:
        overlay.setdefault("num_classes", kwargs["num_classes"])
    return build_model_with_cfg(model_cls, variant, pretrained, pretrained_cfg_overlay=overlay, **kwargs)
