"""Builders of the conformance lists' models from libraries other than timm: each takes the JSON entry's
kwargs, so a list names a model and its small config without code of its own."""
from __future__ import annotations

import importlib
from typing import Any

from torch import nn


def hugging_face(model: str, config: str, **options: Any) -> nn.Module:
    """``transformers.<model>(transformers.<config>(**options))``: random weights, nothing downloaded."""
    transformers = importlib.import_module("transformers")
    return getattr(transformers, model)(getattr(transformers, config)(**options))


def library(target: str, **options: Any) -> nn.Module:
    """Any importable class or function ``package.module.Name`` called with ``options`` (vit-pytorch, open_clip)."""
    module, _, name = target.rpartition(".")
    return getattr(importlib.import_module(module), name)(**options)
