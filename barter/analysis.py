"""What barter remembers of a model's first analysis, and the example inputs it analyses a timm model on."""
from __future__ import annotations

import weakref
from typing import Any, NamedTuple

import torch
from torch import nn

from fxsurgery import Surgeon, UnitGroup


class UnitAnalysis(NamedTuple):
    """The unit groups of a model as barter first analysed it, and the example call they were found with:
    `model(*example_inputs, **example_kwargs)`."""

    groups: list[UnitGroup]
    example_inputs: tuple
    example_kwargs: dict[str, Any]


# weak keys: the groups hold names, layouts and counts, not the model, so an entry dies with its model
_ANALYSES: weakref.WeakKeyDictionary[nn.Module, UnitAnalysis] = weakref.WeakKeyDictionary()


def record_analysis(surgeon: Surgeon) -> None:
    """Remember `surgeon`'s groups for its model, so `barter.export` can tell the model's topology later.

    The first analysis wins: it describes the model as built (every group at its maximum), which a later
    analysis of the resized model cannot (a layer left with one head or none is no group there).
    """
    _ANALYSES.setdefault(surgeon.model, UnitAnalysis(surgeon.groups, surgeon.example_inputs, surgeon.example_kwargs))


def recorded_analysis(model: nn.Module) -> UnitAnalysis | None:
    """The first analysis `barter.wrap` or `barter.load` made of `model`, or None for another model."""
    return _ANALYSES.get(model)


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
