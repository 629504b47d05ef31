"""Training FLOPs counted from the tensor shapes executed in training (paper, Training FLOPs).

``FlopMeter.step`` runs one training step's forward, loss and backward. The first time a signature
(parameter shapes and trainability; input shape, dtype, device type and trainability; train/eval mode) is
seen, the step runs under ``torch.utils.flop_counter.FlopCounterMode``, forward and backward counted
separately; later steps with that signature reuse the count and run without the counter. Counts are FLOPs
(2 per multiply-add); the paper's MACs are half of them: M_train = total_flops / 2, F_total = 2 * M_train.

FlopCounterMode has no formula for CPU scaled-dot-product attention, which torch 2.x dispatches to
``aten._scaled_dot_product_flash_attention_for_cpu`` (and ``..._backward``) when there is no attention
dropout (with dropout it takes the math path of bmm ops, which are counted). Those ops are counted here as
the two matmuls q @ k^T and attn @ v, backward twice that. The fused GPU kernels' backward formulas are
overridden with the same rule (torch's own count includes the score recomputation), so attention counts
do not depend on the device.
"""

import contextlib
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, ContextManager

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

aten = torch.ops.aten

Signature = tuple[Hashable, ...]


def _sdpa_forward(query_shape: torch.Size, key_shape: torch.Size, value_shape: torch.Size,
                  *args: Any, **kwargs: Any) -> int:
    """q @ k^T and attn @ v: 2 * 2 * B * H * Nq * Nk * d FLOPs (d of q/k and of v)."""
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _sdpa_backward(grad_out_shape: torch.Size, query_shape: torch.Size, key_shape: torch.Size,
                   value_shape: torch.Size, *args: Any, **kwargs: Any) -> int:
    """Gradients of both matmuls with respect to both operands: twice the forward."""
    return 2 * sdpa_flop_count(query_shape, key_shape, value_shape)


SDPA_FORMULAS: dict[Any, Callable[..., int]] = {
    aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_forward,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_backward,
    aten._scaled_dot_product_flash_attention_backward: _sdpa_backward,
    aten._scaled_dot_product_efficient_attention_backward: _sdpa_backward,
    aten._scaled_dot_product_cudnn_attention_backward: _sdpa_backward,
}


def flop_counter() -> FlopCounterMode:
    """A silent FlopCounterMode that also counts CPU attention (see the module docstring)."""
    return FlopCounterMode(display=False, custom_mapping=SDPA_FORMULAS)


@dataclass(frozen=True)
class StepFlops:
    """FLOPs of one training step on ``batch_size`` images."""

    forward: int
    backward: int
    batch_size: int

    @property
    def total(self) -> int:
        return self.forward + self.backward

    def scaled(self, batch_size: int) -> "StepFlops":
        """The same step on ``batch_size`` images (the counted FLOPs are linear in the batch size): a
        data-parallel step's FLOPs from those of one process's share."""
        return StepFlops(self.forward * batch_size // self.batch_size, self.backward * batch_size // self.batch_size,
                         batch_size)

    @property
    def forward_macs_per_image(self) -> float:
        """M_fwd: forward multiply-adds per image."""
        return self.forward / 2 / self.batch_size

    @property
    def estimated_flops_per_image(self) -> float:
        """The paper's per-image training estimate 2 * (M_fwd + 2 * M_fwd) (backward taken as 2x forward)."""
        return 2 * 3 * self.forward_macs_per_image


def step_signature(model: nn.Module, inputs: torch.Tensor) -> Signature:
    """What determines a step's FLOPs: parameter names, shapes and trainability; the input's shape, dtype,
    device type and trainability; train/eval mode."""
    params = tuple((name, tuple(p.shape), p.requires_grad) for name, p in model.named_parameters())
    return (model.training, tuple(inputs.shape), inputs.dtype, inputs.device.type, inputs.requires_grad, params)


def run_step(
    model: nn.Module, inputs: torch.Tensor, loss_fn: Callable[[torch.Tensor], torch.Tensor], count: bool, *,
    autocast: Callable[[], ContextManager] = contextlib.nullcontext,
    backward: Callable[[torch.Tensor], None] = torch.Tensor.backward,
) -> tuple[torch.Tensor, torch.Tensor, StepFlops | None]:
    """Forward ``model(inputs)`` and ``loss_fn(outputs)`` under ``autocast()``, then ``backward(loss)``
    (mixed precision scales the loss there); counted if ``count``."""
    if not count:
        with autocast():
            outputs = model(inputs)
            loss = loss_fn(outputs)
        backward(loss)
        return outputs, loss, None
    with flop_counter() as fwd, autocast():
        outputs = model(inputs)
        loss = loss_fn(outputs)
    with flop_counter() as bwd:
        backward(loss)
    return outputs, loss, StepFlops(fwd.get_total_flops(), bwd.get_total_flops(), inputs.shape[0])


class FlopMeter:
    """Runs training steps and accumulates their FLOPs, counting each shape signature only once."""

    def __init__(self) -> None:
        self._cache: dict[Signature, StepFlops] = {}
        self.total_flops = 0
        self.steps = 0
        self.images = 0
        self.last: StepFlops | None = None

    def step(
        self, model: nn.Module, inputs: torch.Tensor, loss_fn: Callable[[torch.Tensor], torch.Tensor],
        global_batch: int | None = None, *, autocast: Callable[[], ContextManager] = contextlib.nullcontext,
        backward: Callable[[torch.Tensor], None] = torch.Tensor.backward,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One training step's forward, loss and backward (no optimizer step); returns (outputs, loss).

        With ``global_batch``, ``inputs`` are one process's share of a data-parallel step on that many images,
        and the step counts the FLOPs of all of them. ``autocast`` and ``backward``: see `run_step`."""
        signature = step_signature(model, inputs)
        cached = self._cache.get(signature)
        outputs, loss, counted = run_step(model, inputs, loss_fn, count=cached is None, autocast=autocast,
                                          backward=backward)
        flops = cached or counted
        self._cache[signature] = flops
        if global_batch is not None:
            flops = flops.scaled(global_batch)
        self.last = flops
        self.total_flops += flops.total
        self.steps += 1
        self.images += flops.batch_size
        return outputs, loss

    @property
    def signatures_counted(self) -> int:
        """How many distinct signatures were counted (each costs one counted step)."""
        return len(self._cache)

    @property
    def total_macs(self) -> int:
        """M_train: cumulative forward + backward multiply-adds of all steps so far."""
        return self.total_flops // 2

    @property
    def f_total(self) -> int:
        """The paper's cumulative training FLOPs F_total = 2 * M_train."""
        return 2 * self.total_macs

    def state_dict(self) -> dict[str, int]:
        """Cumulative counters, for checkpoints (the per-signature cache is rebuilt on demand)."""
        return {"total_flops": self.total_flops, "steps": self.steps, "images": self.images}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.total_flops, self.steps, self.images = state["total_flops"], state["steps"], state["images"]
