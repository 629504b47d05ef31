"""`BarterCallback` for Lightning: BARTER in a `lightning.Trainer` run, checkpoints and DDP included.

    model = MyLightningModule()                      # configure_optimizers builds from self.parameters()
    trainer = lightning.Trainer(max_epochs=10, callbacks=[BarterCallback(density=0.5, seed=0)])
    trainer.fit(model)                               # trainer.fit(model, ckpt_path=...) resumes

Protocol. `barter.wrap` resizes parameters in place, so the model must be compact before the optimizer is built: the
callback wraps in `setup("fit")`, which Lightning runs before `configure_optimizers` (and before it restores a
checkpoint or wraps the model for DDP). `total_steps` defaults to the trainer's `estimated_stepping_batches`. When
fitting starts the callback attaches the optimizer, so transfers run from its post-step hook (after every optimizer
step, gradient accumulation and skipped AMP steps included). On resume the controller state (saved with its sha256,
verified here) is restored from the checkpoint in the module's `on_load_checkpoint` (which Lightning runs before it
loads the weights), so the saved widths are back before the compact weights arrive. Under `strategy="ddp"` the
strategy's DistributedDataParallel wrapper follows the transfers (`barter.ddp.follow_transfers`, as in
`barter.DistributedModel`). Under `ModelParallelStrategy` (FSDP2) the module's `configure_model` shards the model
the callback made compact in `setup`, and the transfers edit the sharded model (`barter.fsdp`); resuming from its
distributed checkpoints is untested. `ddp_spawn` and `ddp_fork` are refused: they fit in child processes, and the
launching process, whose model never became compact, then loads the compact weights of rank 0.

A module too large for one process is built on the meta device with `barter.meta_build.record_build` (the whole
LightningModule's build, so that the record names its parameters as the module does) and handed over with its
record, `BarterCallback(build_record=record, ...)`: the callback wraps it on meta in `setup` (init "first" or
"random"), the module's `configure_model` shards it, and right after that hook every process writes its own shards
of the values the build on the CPU would have drawn, at the units the wrap kept (`barter.meta_build.materialise`).
That is where the strategy would materialise a meta model itself (with `reset_parameters`, other values), before it
converts the precision and builds the optimizer, which so steps the materialised parameters. `configure_model` must
only shard: a layer it makes is not in the record. A module without a `configure_model` (nothing shards it) is
materialised whole in `setup`; one on meta without its record is refused.

Example call. fxsurgery analyses the model on a call made as training makes it. Unless `example_inputs` or
`example_kwargs` is given, that is the module's `example_input_array` passed as Lightning passes it to
`forward` (a dict as keyword arguments, a tuple or list as positional ones, a tensor as the one input), so a
module whose forward takes keyword arguments, as an HF model's does, needs no other example. Without one, or
for a submodule (`module`), whose call it does not describe, wrap falls back to a timm model's input size.
"""
from __future__ import annotations

import functools
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities import move_data_to_device
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..meta_build import BuildRecord
from ..packed_state import pack_state, unpack_state
from .base import WrappingCallback
from .lightning_compat import fits_in_child_processes


class BarterCallback(WrappingCallback, pl.Callback):
    """Wrap the LightningModule (or its submodule `module`, an attribute path) with `barter.wrap(**wrap_options)`."""

    def __init__(self, *, module: str | None = None, total_steps: int | None = None,
                 build_record: BuildRecord | None = None, **wrap_options: Any) -> None:
        super().__init__(module=module, total_steps=total_steps, build_record=build_record, wrap_options=wrap_options)
        self._restored = False

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit" or self.controller is not None:
            return
        if fits_in_child_processes(trainer):
            raise RuntimeError("BarterCallback cannot fit in processes the Trainer spawns or forks (ddp_spawn, "
                               "ddp_fork): the launching process would load the compact weights into its "
                               "full-width model; use strategy='ddp' (one process per device, as torchrun starts)")
        target = self._target(pl_module)
        on_meta = self._built_on_meta(pl_module)
        if not on_meta:
            target.to(trainer.strategy.root_device)  # the controller's score tables live on the model's device
        example = {} if self._example_given else self._example_call(pl_module, target)
        self._wrap(pl_module, self.total_steps or int(trainer.estimated_stepping_batches), None, **example)
        if on_meta:
            self._materialise_once_sharded(trainer, pl_module)
        original = pl_module.on_load_checkpoint

        def restore_widths_first(checkpoint: dict[str, Any]) -> None:
            self._restore_widths(checkpoint, source=f"{trainer.ckpt_path} ({self.state_key})")
            original(checkpoint)

        pl_module.on_load_checkpoint = restore_widths_first  # runs before Lightning loads the weights

    def _materialise_once_sharded(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Materialise the module wrapped on meta as soon as its `configure_model` has sharded it: before the
        strategy builds the optimizer on its parameters (and before the strategy's own materialisation, which
        would draw other values). A module without a `configure_model` (nothing shards it) is materialised whole
        now."""
        device = trainer.strategy.root_device
        if not is_overridden("configure_model", pl_module):
            self._materialise(pl_module, device)
            return
        original = pl_module.configure_model

        @functools.wraps(original)  # Lightning still sees the module's own hook (`is_overridden`)
        def shard_then_materialise() -> None:
            original()
            self._materialise(pl_module, device)

        pl_module.configure_model = shard_then_materialise

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            for hook in ("on_load_checkpoint", "configure_model"):
                vars(pl_module).pop(hook, None)
            self._stop_following()

    def _restore_widths(self, checkpoint: dict[str, Any], source: str) -> None:
        saved = checkpoint.get("callbacks", {}).get(self.state_key)
        if saved is None or saved.get("state") is None:
            raise ValueError(f"the checkpoint holds no {self.state_key} state; it was not made with BARTER")
        self._restore(saved, source)
        self._restored = True

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if len(trainer.optimizers) != 1:
            raise ValueError(f"BarterCallback needs exactly one optimizer, got {len(trainer.optimizers)}")
        self.controller.attach_optimizer(trainer.optimizers[0])
        if isinstance(trainer.strategy.model, DistributedDataParallel):
            self._follow(trainer.strategy.model)

    def state_dict(self) -> dict[str, Any]:
        """The controller's state serialised with its sha256 (`barter.serialization.pack_state`), which restoring
        verifies."""
        return {"controller": None} if self.controller is None else pack_state(self.controller.state_dict())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Lightning calls this after it loaded the weights; the controller was restored before them."""
        if not self._restored and self.controller is not None:
            self._restore(state_dict, f"the checkpoint's {self.state_key} state")

    @staticmethod
    def _example_call(pl_module: pl.LightningModule, target: nn.Module) -> dict[str, Any]:
        """wrap's example arguments from the module's `example_input_array`, on its device, as Lightning calls
        `forward` with it; none (wrap's timm default) without one or for a submodule."""
        example = pl_module.example_input_array if target is pl_module else None
        if example is None:
            return {}
        example = move_data_to_device(example, next(target.parameters()).device)
        if isinstance(example, dict):
            return {"example_kwargs": example}
        return {"example_inputs": tuple(example) if isinstance(example, (tuple, list)) else (example,)}


def controller_state(saved: dict[str, Any], source: str) -> dict[str, Any]:
    """The controller state in the callback's checkpoint entry `saved`, its sha256 verified (ExportError naming
    `source` when it is damaged)."""
    return unpack_state(saved, source)
