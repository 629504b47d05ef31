"""The loss scale of mixed-precision training: what a GradScaler multiplied this backward's gradients by."""
from __future__ import annotations

from typing import Any, Protocol

from torch import Tensor

from .compat import device_scale


class Scaler(Protocol):
    """What the controller reads of a `torch.amp.GradScaler` (or anything shaped like one)."""

    def is_enabled(self) -> bool: ...

    def get_scale(self) -> float: ...


def current_scale(scaler: Scaler | Any | None) -> Tensor | float:
    """The scaler's current scale, as its device tensor when it has one (no host sync), else a float;
    1.0 without a scaler or with a disabled one."""
    if scaler is None or not scaler.is_enabled():
        return 1.0
    scale = device_scale(scaler)
    return scale if scale is not None else float(scaler.get_scale())
