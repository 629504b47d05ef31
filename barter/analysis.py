"""What barter keeps on a model about its base (`model.barter_base`), and the example inputs it analyses a timm
model on."""
from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn

from fxsurgery import Analysis

BASE_ATTRIBUTE = "barter_base"


class ModelBase(NamedTuple):
    """What a model was built as, kept on it as `model.barter_base` (the way timm keeps `pretrained_cfg`): a plain
    attribute that `copy.deepcopy` and pickling keep, set by `barter.wrap` and restored by `barter.load`.

    analysis: fxsurgery's analysis of the model as built (every group at its maximum count, found on its
    example call), or None when `load` had nothing to resize. architecture, model_kwargs: what rebuilds it
    (a timm name, or "transformers:<class>" and its config) when `load` built it, else None and {}. call: the
    example call `load` read from the export's topology (shapes, dtypes and values), else None.
    """

    analysis: Analysis | None
    architecture: str | None
    model_kwargs: dict[str, Any]
    call: dict[str, Any] | None


def model_base(model: nn.Module) -> ModelBase | None:
    """The base barter recorded on `model`, or None for a model `wrap` and `load` never saw."""
    base = model.__dict__.get(BASE_ATTRIBUTE)
    return base if isinstance(base, ModelBase) else None


def keep_base(model: nn.Module, base: ModelBase) -> None:
    """Record `base` on `model` unless one is there: the first describes the model as built, which an analysis of
    the resized model cannot (a layer left with one head or none is no group there)."""
    if model_base(model) is None:
        analysis = base.analysis and base.analysis.without_plan()  # its graphs are of no use once installed
        setattr(model, BASE_ATTRIBUTE, base._replace(analysis=analysis))


def default_example_inputs(model: nn.Module) -> tuple[torch.Tensor]:
    """A zero batch of two images shaped like a timm model's `pretrained_cfg["input_size"]`.

    timm keeps the registry's input size in `pretrained_cfg` even when a model is built with another
    `img_size`, so the first `img_size` attribute of the model or a submodule (the patch embedding's), where
    present, wins.
    """
    cfg = getattr(model, "pretrained_cfg", None) or {}
    if "input_size" not in cfg:
        raise ValueError("example_inputs is required for a model without timm's pretrained_cfg['input_size']")
    c, h, w = cfg["input_size"]
    size = next((m.img_size for m in model.modules() if isinstance(getattr(m, "img_size", None), (int, tuple))), None)
    if isinstance(size, int):
        h = w = size
    elif size is not None and len(size) == 2:
        h, w = size
    p = next(model.parameters())
    return (torch.zeros(2, c, h, w, dtype=p.dtype, device=p.device),)
