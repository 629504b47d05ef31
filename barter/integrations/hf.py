"""`BarterCallback` for the Hugging Face `transformers.Trainer`: BARTER in a Trainer run, checkpoints included.

    callback = BarterCallback(module="net", density=0.5, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[callback])
    trainer.train()

    # resume: name the checkpoint to the callback too, so the model has the saved widths before the weights load
    callback = BarterCallback(module="net", density=0.5, seed=0, resume_from="out/checkpoint-8")
    trainer = Trainer(model=fresh_model, args=args, train_dataset=data, callbacks=[callback])
    trainer.train(resume_from_checkpoint="out/checkpoint-8")

Protocol. The Trainer builds its optimizer before the first callback event of `train`, so the callback wraps in
`on_train_begin` and hands that optimizer to `barter.wrap`, which compacts its parameters in place (the same
Parameter objects, so the optimizer's param groups and the lr scheduler keep working). `total_steps` defaults
to the Trainer's `state.max_steps`. Transfers run from the optimizer's post-step hook (after every optimizer
step; a step that AMP's GradScaler skipped is not counted). `on_save` writes the controller beside the weights
(`barter.pt` in the checkpoint folder). The Trainer loads a checkpoint's weights before any callback event,
so a resumed run names the checkpoint to the callback (`resume_from`): at the end of the Trainer's `__init__`
(the model on its device) the callback wraps the model and restores the saved widths, then the compact weights
and optimizer state fit.

Under DDP (torchrun, `accelerate launch`) the Trainer builds its DistributedDataParallel wrapper before any
callback event and hands it to none, and its training loop keeps a reference to it. The callback finds it at
its first forward (a one-shot global forward pre-hook), rebuilds its reducer in place for the compact model,
and keeps that same object valid across the transfers (`barter.ddp.follow_transfers`). FSDP and DeepSpeed are refused.
"""
from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.nn.parallel import DistributedDataParallel
from torch.utils.hooks import RemovableHandle
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from ..controller import Controller
from ..ddp import follow_transfers, rebuild_reducer, world_size
from ..wrapping import wrap

STATE_FILE = "barter.pt"


class BarterCallback(TrainerCallback):
    """Wrap the Trainer's model (or its submodule `module`, an attribute path) with `barter.wrap(**wrap_options)`."""

    def __init__(self, *, module: str | None = None, total_steps: int | None = None,
                 resume_from: str | os.PathLike | None = None, **wrap_options: Any) -> None:
        if "optimizer" in wrap_options or "model" in wrap_options:
            raise TypeError("BarterCallback wraps the trainer's own model and optimizer; pass wrap's other options")
        self.module = module
        self.total_steps = total_steps
        self.resume_from = resume_from
        self.wrap_options = wrap_options
        self.controller: Controller | None = None
        self._hooks: list[RemovableHandle] = []

    def _target(self, model: nn.Module) -> nn.Module:
        return model.get_submodule(self.module) if self.module else model

    def _wrap(self, model: nn.Module, total_steps: int, optimizer: torch.optim.Optimizer | None) -> None:
        self.total_steps = total_steps
        self.controller = wrap(self._target(model), optimizer, total_steps=total_steps, **self.wrap_options)

    def on_init_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, *,
                    model: nn.Module, **kwargs: Any) -> None:
        """With `resume_from`: wrap now and restore the saved widths, before the Trainer loads the weights."""
        if self.resume_from is None or self.controller is not None:
            return
        path = os.path.join(self.resume_from, STATE_FILE)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} not found: {self.resume_from} is not a checkpoint of a BARTER run")
        saved = torch.load(path, map_location="cpu", weights_only=True)
        self._wrap(model, saved["total_steps"], optimizer=None)
        self.controller.load_state_dict(saved["controller"])

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, *,
                       model: nn.Module, optimizer: torch.optim.Optimizer, **kwargs: Any) -> None:
        inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps the torch one
        if self.controller is None:
            if state.global_step > 0:
                raise ValueError("resuming a BARTER run: pass the checkpoint as BarterCallback(resume_from=...)")
            self._wrap(model, self.total_steps or state.max_steps, inner)
        else:
            if self.controller.step_count != state.global_step:
                raise ValueError(f"the controller restored from {self.resume_from} is at step "
                                 f"{self.controller.step_count}, the Trainer resumes at step {state.global_step}")
            self.controller.attach_optimizer(inner)
        self.controller.track_scaler(getattr(optimizer, "scaler", None))
        if world_size() > 1:
            self._follow_the_trainers_wrapper(model)

    def _follow_the_trainers_wrapper(self, model: nn.Module) -> None:
        """At the model's first forward, find the DistributedDataParallel wrapper the Trainer runs it through
        and keep it valid across the transfers; a training forward of the model outside one is refused."""

        def find_the_wrapper(module: nn.Module, args: tuple) -> None:
            if isinstance(module, DistributedDataParallel) and module.module is model:
                search.remove()
                rebuild_reducer(module)  # the Trainer built it before the wrap made the model compact
                self._hooks.append(follow_transfers(module, self.controller))
            elif module is model and model.training:
                search.remove()
                raise RuntimeError("under torch.distributed the HF BarterCallback needs the Trainer to run the "
                                   "model through DistributedDataParallel, which it did not (FSDP and DeepSpeed "
                                   "cannot follow the transfers)")

        search = register_module_forward_pre_hook(find_the_wrapper)
        self._hooks.append(search)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        """Write the controller into the checkpoint folder the Trainer just saved."""
        if state.is_world_process_zero:
            folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            torch.save({"total_steps": self.total_steps, "controller": self.controller.state_dict()},
                       os.path.join(folder, STATE_FILE))
