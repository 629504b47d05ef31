"""Mixed precision of a training run: the autocast dtype and, for fp16, the GradScaler (`TrainConfig.amp`).

"fp32" (the default, as the paper trains) uses neither. "bf16" autocasts the forward to bfloat16 without loss
scaling; "fp16" autocasts to float16 and scales the loss with `torch.amp.GradScaler`, which skips the optimizer
step on inf gradients. The controller tracks the scaler, so scores do not depend on the scale, and the
schedule counts only the steps that ran (`barter.Controller`).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .config import AMP_MODES

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Precision:
    """How a training step runs its forward (autocast), its backward (loss scaling) and its optimizer step."""

    mode: str = "fp32"
    device_type: str = "cpu"
    scaler: torch.amp.GradScaler | None = None

    def autocast(self) -> contextlib.AbstractContextManager:
        dtype = DTYPES[self.mode]
        return contextlib.nullcontext() if dtype is None else torch.autocast(self.device_type, dtype=dtype)

    def backward(self, loss: Tensor) -> None:
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer step (skipped by the scaler when a gradient is not finite)."""
        if self.scaler is None:
            optimizer.step()
            return
        self.scaler.step(optimizer)
        self.scaler.update()

    def state_dict(self) -> dict[str, Any]:
        return {} if self.scaler is None else self.scaler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)


def supports(mode: str, device: torch.device) -> bool:
    """Whether `device` can autocast to `mode`'s dtype (bf16 on CUDA needs a GPU that has it)."""
    if DTYPES[mode] is None:
        return True
    if not torch.amp.is_autocast_available(device.type):
        return False
    return not (mode == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported())


def build_precision(mode: str, device: torch.device) -> Precision:
    """The Precision of `mode` on `device`; ValueError where the device cannot run it."""
    if mode not in AMP_MODES:
        raise ValueError(f"amp must be one of {AMP_MODES}, got {mode!r}")
    if not supports(mode, device):
        raise ValueError(f"amp {mode} is not supported on {device}; use fp32" + (" or bf16" * (mode == "fp16")))
    scaler = torch.amp.GradScaler(device.type) if mode == "fp16" else None
    return Precision(mode, device.type, scaler)
