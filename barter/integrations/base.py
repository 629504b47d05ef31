"""What every framework's `BarterCallback` does the same way, whatever the framework: refuse the model and optimizer
among `barter.wrap`'s options, wrap the model (or its submodule `module`) with them, keep a DistributedDataParallel
wrapper valid across the transfers, stop following it, and restore the controller from its packed state. A
framework's callback derives from `WrappingCallback` and its framework's callback class, and adds only when, in its
framework's events, each of these happens. A model built on the meta device (`barter.meta_build.record_build`) is
wrapped there and given its values once the framework has sharded it (`build_record`)."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.hooks import RemovableHandle

from ..controller import Controller
from ..ddp import follow_transfers
from ..meta_build import BuildRecord, materialise
from ..packed_state import unpack_state
from ..wrapping import wrap


class WrappingCallback:
    """The framework-free part of a `BarterCallback`: `barter.wrap(**wrap_options)` of the trainer's model (or its
    submodule `module`, an attribute path), the live controller as `.controller`."""

    def __init__(self, *, module: str | None, total_steps: int | None, build_record: BuildRecord | None,
                 wrap_options: dict[str, Any]) -> None:
        if "optimizer" in wrap_options or "model" in wrap_options:
            raise TypeError("BarterCallback wraps the trainer's own model and optimizer; pass wrap's other options")
        self.module = module
        self.total_steps = total_steps
        self.build_record = build_record  # of a model built on meta: materialised once the framework has sharded it
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

    def _built_on_meta(self, model: nn.Module) -> bool:
        """Whether `model` is on the meta device; refused there without the record of its build."""
        on_meta = any(p.is_meta for p in model.parameters())
        if on_meta and self.build_record is None:
            raise ValueError("the trainer's model is on the meta device and nothing gives it values: build it with "
                             "barter.meta_build.record_build and pass BarterCallback(build_record=record)")
        return on_meta

    def _materialise(self, model: nn.Module, device: torch.device) -> None:
        """Give `model`, built on the meta device, wrapped there and sharded since, each process's shards of the
        values its build on the CPU would have drawn, at the units the wrap kept (`barter.meta_build.materialise`)."""
        if self._built_on_meta(model):
            materialise(model, self.build_record, device, controller=self.controller)

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
