"""Averaged copies of a wrapped model (timm `ModelEmaV2`/`ModelEmaV3`, `torch.optim.swa_utils.AveragedModel`)
that follow its transfers (`Controller.track`).

The copy is found inside the averaging wrapper by its parameters: the wrapper itself or one of its children
with exactly the live model's parameter names and shapes (timm's and torch's `.module`). A second
`fxsurgery.Surgeon` on it finds the same unit groups by name, and every edit of the live model is repeated
there: the donor unit is removed, the parent's averaged unit is cloned with its output weights split in
halves without noise, so the averaged model's outputs are unchanged by the clone half.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from fxsurgery import Surgeon


def averaged_module(wrapper: nn.Module, model: nn.Module) -> nn.Module:
    """The module inside `wrapper` shaped exactly like `model`; ValueError when there is none."""
    shapes = {name: p.shape for name, p in model.named_parameters()}
    for candidate in (wrapper, *wrapper.children()):
        if {name: p.shape for name, p in candidate.named_parameters()} == shapes:
            return candidate
    raise ValueError(f"{type(wrapper).__name__} holds no copy of the model with its current parameter shapes; "
                     "make the averaged copy after barter.wrap (or after ctl.load_state_dict when resuming)")


def _to_device(value: Any, device: torch.device) -> Any:
    """A tensor of the example call moved to `device`; a flag or None as it is."""
    return value.to(device) if isinstance(value, Tensor) else value


class AveragedCopy:
    """An averaged copy of the live model, edited alike by unit-group name."""

    def __init__(self, wrapper: nn.Module, live: Surgeon) -> None:
        """Analyse the copy in `wrapper` on the example call of `live`, the live model's surgeon, on its device."""
        self.wrapper = wrapper
        self.module = averaged_module(wrapper, live.model)
        device = next(self.module.parameters()).device
        self.surgeon = Surgeon(self.module, example_inputs=tuple(_to_device(x, device) for x in live.example_inputs),
                               example_kwargs={k: _to_device(v, device) for k, v in live.example_kwargs.items()})

    def remove(self, group: str, index: int) -> None:
        self.surgeon.remove(self.surgeon.group(group), index)

    def clone(self, group: str, parent: int) -> None:
        self.surgeon.clone(self.surgeon.group(group), parent)
