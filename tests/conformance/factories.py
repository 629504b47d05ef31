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
    """Any importable class or function ``package.module.Name`` called with ``options`` (vit-pytorch, open_clip);
    JSON lists are passed as the tuples such libraries test for (PiT's ``depth``)."""
    module, _, name = target.rpartition(".")
    return getattr(importlib.import_module(module), name)(**{k: _tuples(v) for k, v in options.items()})


def _tuples(value: Any) -> Any:
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value
