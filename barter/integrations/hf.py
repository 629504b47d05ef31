"""`BarterCallback` for the Hugging Face `transformers.Trainer`: BARTER in a Trainer run, checkpoints included.

    callback = BarterCallback(density=0.5, seed=0)   # module="net": only that submodule
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[callback])
    trainer.train()

    # resume: name the checkpoint to the callback too, so the model has the saved widths before the weights load
    callback = BarterCallback(density=0.5, seed=0, resume_from="out/checkpoint-8")
    trainer = Trainer(model=fresh_model, args=args, train_dataset=data, callbacks=[callback])
    trainer.train(resume_from_checkpoint="out/checkpoint-8")

Protocol. The Trainer builds its optimizer before the first callback event of `train`, so the callback wraps in
`on_train_begin` and hands that optimizer to `barter.wrap`, which compacts its parameters in place (the same Parameter
objects, so the optimizer's param groups and the lr scheduler keep working). `total_steps` defaults to the Trainer's
`state.max_steps`. Transfers run from the optimizer's post-step hook (after every optimizer step; a step that AMP's
GradScaler skipped is not counted). `on_save` writes the controller beside the weights (`barter.pt` in the checkpoint
folder, with the sha256 of the state, which resuming verifies). The Trainer loads a checkpoint's weights before any
callback event, so a resumed run names the checkpoint to the callback (`resume_from`): at the end of the Trainer's
`__init__` (the model on its device) the callback wraps the model and restores the saved widths, then the compact
weights and optimizer state fit.

Example call. fxsurgery analyses the model on a call made as training makes it, and the Trainer calls its model
as `model(**batch)`. So without `example_inputs` or `example_kwargs` the callback takes the first batch of the
Trainer's train dataloader (on the model's device, `labels` included) as `example_kwargs`: an ordinary HF model
needs no example. Reading it leaves the run as it was (`first_batch`). It is saved in `barter.pt` as well, since
a resumed run wraps in `on_init_end`, before the Trainer has a dataloader. With `module` the batch is not the
submodule's call: pass the submodule's example, or let `barter.wrap` use a timm model's input size.

Under DDP (torchrun, `accelerate launch`) the Trainer builds its DistributedDataParallel wrapper before any
callback event and hands it to none, and its training loop keeps a reference to it. The callback finds it at
its first forward (a one-shot global forward pre-hook), rebuilds its reducer in place for the compact model,
and keeps that same object valid across the transfers (`barter.ddp.follow_transfers`).

Under FSDP2 (accelerate's FSDP plugin at version 2: `TrainingArguments(fsdp=..., fsdp_config={"version": 2})` or
`accelerate launch` with FSDP version 2) the Trainer shards the model before `on_train_begin`, and `barter.wrap`
analyses the whole model, so the callback wraps at the end of the Trainer's `__init__`, before the Trainer has a
dataloader: pass `example_kwargs` (the keyword arguments of one training call). The optimizer the Trainer then
builds on the sharded parameters is attached in `on_train_begin`, and the transfers edit the sharded model
(`barter.fsdp`). FSDP1 and DeepSpeed are refused; resuming an FSDP2 run is not supported.

A model too large for one process is built on the meta device with `barter.meta_build.record_build` and handed to the
Trainer with its record, `BarterCallback(build_record=record, ...)`: the callback wraps it there (init "first" or
"random"), accelerate shards it, and in `on_train_begin` every process writes its own shards of the values the build
on the CPU would have drawn, at the units the wrap kept (`barter.meta_build.materialise`).
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
from accelerate.state import AcceleratorState
from accelerate.utils import send_to_device
from torch import nn
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from ..ddp import rebuild_reducer, world_size
from ..files import ExportError
from ..fsdp import SUPPORTED, UnsupportedSharding
from ..meta_build import BuildRecord
from ..packed_state import pack_state, unpack_state
from .base import WrappingCallback

STATE_FILE = "barter.pt"


class BarterCallback(WrappingCallback, TrainerCallback):
    """Wrap the Trainer's model (or its submodule `module`, an attribute path) with `barter.wrap(**wrap_options)`."""

    def __init__(self, *, module: str | None = None, total_steps: int | None = None,
                 resume_from: str | os.PathLike | None = None, build_record: BuildRecord | None = None,
                 **wrap_options: Any) -> None:
        super().__init__(module=module, total_steps=total_steps, build_record=build_record, wrap_options=wrap_options)
        self.resume_from = resume_from
        self.example_batch: dict[str, Any] | None = None  # the first batch, when it is the example call

    @property
    def _takes_a_batch(self) -> bool:
        """The Trainer's batch is the example call: of the model itself, and no example given."""
        return self.module is None and not self._example_given

    def _wrap_on_batch(self, model: nn.Module, total_steps: int, optimizer: torch.optim.Optimizer | None) -> None:
        """Wrap, on the example batch when it is the example call."""
        example = {} if self.example_batch is None else {"example_kwargs": self.example_batch}
        self._wrap(model, total_steps, optimizer, **example)

    def on_init_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, *,
                    model: nn.Module, **kwargs: Any) -> None:
        """With `resume_from`: wrap now and restore the saved widths, before the Trainer loads the weights. Under
        FSDP2: wrap now, before the Trainer shards the model."""
        sharding = trainer_sharding()
        if sharding == "fsdp2" and self.controller is None:
            if self.resume_from is not None:
                raise UnsupportedSharding("resuming a BARTER run under the Trainer's FSDP2 is not supported")
            if self._takes_a_batch:
                raise ValueError("under FSDP2 the callback wraps the model before the Trainer shards it, when the "
                                 "Trainer has no dataloader yet: pass BarterCallback(example_kwargs=...), the keyword "
                                 "arguments of a training call")
            total_steps = self.total_steps or args.max_steps
            if total_steps < 1:
                raise ValueError("under FSDP2 the callback wraps before the Trainer counts its steps: pass "
                                 "BarterCallback(total_steps=...) or TrainingArguments(max_steps=...)")
            self._wrap_on_batch(model, total_steps, optimizer=None)
            return
        if self.resume_from is None or self.controller is not None:
            return
        path = os.path.join(self.resume_from, STATE_FILE)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} not found: {self.resume_from} is not a checkpoint of a BARTER run")
        saved = read_state(path)
        if self._takes_a_batch:
            if saved.get("batch") is None:
                raise ValueError(f"{path} holds no example batch and the Trainer has no dataloader yet: pass "
                                 "BarterCallback(example_kwargs=...), the keyword arguments of a training call")
            self.example_batch = send_to_device(saved["batch"], next(model.parameters()).device)
        self._wrap_on_batch(model, saved["total_steps"], optimizer=None)
        self.controller.load_state_dict(saved["controller"])

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, *,
                       model: nn.Module, optimizer: torch.optim.Optimizer, train_dataloader: DataLoader,
                       **kwargs: Any) -> None:
        inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps the torch one
        self._materialise(model, args.device)
        if self.controller is None:
            if state.global_step > 0:
                raise ValueError("resuming a BARTER run: pass the checkpoint as BarterCallback(resume_from=...)")
            if self._takes_a_batch:
                self.example_batch = first_batch(train_dataloader, next(model.parameters()).device)
            self._wrap_on_batch(model, self.total_steps or state.max_steps, inner)
        else:
            if self.controller.step_count != state.global_step:
                raise ValueError(f"the controller restored from {self.resume_from} is at step "
                                 f"{self.controller.step_count}, the Trainer resumes at step {state.global_step}")
            self.controller.attach_optimizer(inner)
        self.controller.track_scaler(getattr(optimizer, "scaler", None))
        if world_size() > 1 and trainer_sharding() != "fsdp2":
            self._follow_the_trainers_wrapper(model)

    def _follow_the_trainers_wrapper(self, model: nn.Module) -> None:
        """At the model's first forward, find the DistributedDataParallel wrapper the Trainer runs it through
        and keep it valid across the transfers; a training forward of the model outside one is refused."""

        def find_the_wrapper(module: nn.Module, args: tuple) -> None:
            if isinstance(module, DistributedDataParallel) and module.module is model:
                search.remove()
                rebuild_reducer(module)  # the Trainer built it before the wrap made the model compact
                self._follow(module)
            elif module is model and model.training:
                search.remove()
                raise RuntimeError("under torch.distributed the HF BarterCallback needs the Trainer to run the "
                                   "model through DistributedDataParallel, which it did not (FSDP and DeepSpeed "
                                   "cannot follow the transfers)")

        search = register_module_forward_pre_hook(find_the_wrapper)
        self._hooks.append(search)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        self._stop_following()

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        """Write the controller (and the example batch, for a resumed run) into the checkpoint folder just saved."""
        if state.is_world_process_zero:
            folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            torch.save(pack_state({"total_steps": self.total_steps, "controller": self.controller.state_dict(),
                                   "batch": self.example_batch}), os.path.join(folder, STATE_FILE))


def trainer_sharding() -> str | None:
    """How the Trainer's accelerator spreads the model over processes: "fsdp2", None (one process or DDP), or an
    UnsupportedSharding error for FSDP1 and DeepSpeed, naming what is supported."""
    state = AcceleratorState()
    if getattr(state, "deepspeed_plugin", None) is not None:
        raise UnsupportedSharding(f"DeepSpeed partitions the parameters BARTER resizes; supported: {SUPPORTED}")
    plugin = getattr(state, "fsdp_plugin", None)
    if plugin is None:
        return None
    if getattr(plugin, "fsdp_version", 1) != 2:
        raise UnsupportedSharding(f"the Trainer's FSDP1 flattens the parameters BARTER resizes: set "
                                  f"fsdp_config={{'version': 2}}; supported: {SUPPORTED}")
    return "fsdp2"


def read_state(path: str) -> dict[str, Any]:
    """The callback's state saved at `path` by `on_save`, its sha256 verified."""
    try:
        return unpack_state(torch.load(path, map_location="cpu", weights_only=True), path)
    except ExportError:
        raise
    except Exception as e:  # torch.load raises many types for a damaged file
        raise ExportError(f"{path} is damaged ({type(e).__name__}: {e})") from e


def first_batch(loader: DataLoader, device: torch.device) -> dict[str, Any]:
    """The keyword arguments of the Trainer's first `model(**batch)`: `loader`'s first batch, on `device`.

    It is read from the plain DataLoader under accelerate's wrapper (iterating the wrapper would leave it
    registered in accelerate's gradient state), and torch's random state, which a new DataLoader iterator draws
    its seeds from, is restored after, so the run draws the same batches and random numbers as without it.
    """
    loader = getattr(loader, "base_dataloader", loader)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        batch = next(iter(loader))
    if not isinstance(batch, Mapping):
        raise TypeError(f"the Trainer calls its model as model(**batch), but the first batch is a "
                        f"{type(batch).__name__}; pass BarterCallback(example_inputs=...)")
    return dict(send_to_device(batch, device))
