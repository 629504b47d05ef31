"""What every framework's `BarterCallback` does the same way, whatever the framework: refuse the model and optimizer
among `barter.wrap`'s options, wrap the model (or its submodule `module`) with them, keep a DistributedDataParallel
wrapper valid across the transfers, stop following it, and restore the controller from its packed state. A
framework's callback derives from `WrappingCallback` and its framework's callback class, and adds only when, in its
framework's events, each of these happens."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.hooks import RemovableHandle

from ..controller import Controller
from ..ddp import follow_transfers
from ..packed_state import unpack_state
from ..wrapping import wrap


class WrappingCallback:
    """The framework-free part of a `BarterCallback`: `barter.wrap(**wrap_options)` of the trainer's model (or its
    submodule `module`, an attribute path), the live controller as `.controller`."""

    def __init__(self, *, module: str | None, total_steps: int | None, wrap_options: dict[str, Any]) -> None:
        if "optimizer" in wrap_options or "model" in wrap_options:
            raise TypeError("BarterCallback wraps the trainer's own model and optimizer; pass wrap's other options")
        self.module = module
        self.total_steps = total_steps
        self.wrap_options = wrap_options
        self.controller: Controller | None = None
        self._hooks: list[RemovableHandle] = []  # live while the framework fits

    @property
    def _example_given(self) -> bool:
        """Whether `wrap_options` hold the example call (else the callback finds one in the framework, or wrap
        falls back to a timm model's input size)."""
        return self.wrap_options.get("example_inputs") is not None or bool(self.wrap_options.get("example_kwargs"))

    def _target(self, model: nn.Module) -> nn.Module:
        return model.get_submodule(self.module) if self.module else model

    def _wrap(self, model: nn.Module, total_steps: int, optimizer: torch.optim.Optimizer | None,
              **example: Any) -> None:
        """Wrap the target of `model` for `total_steps` (`example`: the call found in the framework, over the
        options' one)."""
        self.total_steps = total_steps
        self.controller = wrap(self._target(model), optimizer, total_steps=total_steps,
                               **{**self.wrap_options, **example})

    def _follow(self, ddp_model: DistributedDataParallel) -> None:
        """Keep the framework's DistributedDataParallel wrapper valid across the transfers until `_stop_following`."""
        self._hooks.append(follow_transfers(ddp_model, self.controller))

    def _stop_following(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def _restore(self, packed: Any, source: str) -> None:
        """Load the controller's state from its packed form (`barter.packed_state`), verified first: ExportError
        naming `source` when it is damaged."""
        self.controller.load_state_dict(unpack_state(packed, source))
