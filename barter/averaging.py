"""Averaged copies of a wrapped model (timm `ModelEmaV2`/`ModelEmaV3`, `torch.optim.swa_utils.AveragedModel`)
that follow its transfers (`Controller.track`).

The copy is found inside the averaging wrapper by its parameters: the wrapper itself or one of its children
with exactly the live model's parameter names and shapes (timm's and torch's `.module`). Its surgeon holds the
live model's unit groups (`Surgeon.of_copy`: an analysis of the compact copy might find fewer), and every edit of
the live model is repeated there: the donor unit is removed, the parent's averaged unit is cloned with its output
weights split in halves without noise, so the averaged model's outputs are unchanged by the clone half.
"""
from __future__ import annotations

from torch import nn

from fxsurgery import Surgeon


def averaged_module(wrapper: nn.Module, model: nn.Module) -> nn.Module:
    """The module inside `wrapper` shaped exactly like `model`; ValueError when there is none."""
    shapes = {name: p.shape for name, p in model.named_parameters()}
    for candidate in (wrapper, *wrapper.children()):
        if {name: p.shape for name, p in candidate.named_parameters()} == shapes:
            return candidate
    raise ValueError(f"{type(wrapper).__name__} holds no copy of the model with its current parameter shapes; "
                     "make the averaged copy after barter.wrap (or after ctl.load_state_dict when resuming)")


class AveragedCopy:
    """An averaged copy of the live model, edited alike by unit-group name."""

    def __init__(self, wrapper: nn.Module, live: Surgeon) -> None:
        """The copy in `wrapper`, edited through `live`'s (the live model's surgeon) groups: the copy is a deep copy
        of the installed model (timm's and torch's wrappers make one)."""
        self.wrapper = wrapper
        self.module = averaged_module(wrapper, live.model)
        self.surgeon = live.of_copy(self.module)

    def remove(self, group: str, index: int) -> None:
        self.surgeon.remove(self.surgeon.group(group), index)

    def clone(self, group: str, parent: int) -> None:
        self.surgeon.clone(self.surgeon.group(group), parent)
