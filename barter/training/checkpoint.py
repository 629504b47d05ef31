"""What a checkpoint holds besides the weights, and how a run starts from one: the trainer state, the random
states, and the configuration checks of resuming and continuing."""
from __future__ import annotations

import os
import random
import shutil
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from ..fsdp import is_sharded, whole_copy
from ..method import TrainingMethod
from ..serialization import export, replace_directory, write_export
from . import processes
from .config import TrainConfig
from .pretrained import build_model
from .recipe import WarmupCosine
from .runlog import TRAINER_STATE, CheckpointError, RunDir, find_checkpoint, load_checkpoint
from .session import Data, Session, example_batch, model_arguments

# config fields that may change between a checkpoint and the run that resumes or continues it
RUNTIME_FIELDS = frozenset({"device", "workers", "progress", "out_dir", "name", "data_dir"})
CONTINUATION_FIELDS = frozenset({"continue_from", "flop_budget"})
SHARDS_STAGING = "shards.tmp"  # where the ranks of an FSDP2 run write a checkpoint's shards before rank 0 moves them


def source_checkpoint(config: TrainConfig, run: RunDir, resume: bool) -> dict[str, Any] | None:
    """The checkpoint to start from: the run's own (resume), the endpoint to continue, or None."""
    if resume:
        state = resume_state(run)
        check_compatible(state["config"], config, RUNTIME_FIELDS)
    elif config.continue_from is not None:
        state = load_checkpoint(find_checkpoint(config.continue_from, "last"))
        check_compatible(state["config"], config, RUNTIME_FIELDS | CONTINUATION_FIELDS)
        if not state["finished"]:
            raise CheckpointError(f"{config.continue_from} has not finished; resume it before continuing it")
    else:
        return None
    return state


def resume_state(run: RunDir) -> dict[str, Any]:
    """The last checkpoint; when it is damaged or missing, the previous one, with a warning naming the damage
    (the damaged one is removed, so that saving the next one keeps the good one as `previous`)."""
    try:
        return load_checkpoint(run.last)
    except CheckpointError as damage:
        if not run.previous.is_dir():
            raise
        try:
            state = load_checkpoint(run.previous)
        except CheckpointError as e:
            raise CheckpointError(f"{damage}; the previous checkpoint is no better: {e}") from e
        warnings.warn(f"{damage}; resuming from the previous checkpoint {run.previous} (epoch {state['epoch']:g}), "
                      "the epochs after it are trained again", stacklevel=3)
        if processes.is_main():
            shutil.rmtree(run.last, ignore_errors=True)
        return state


def repair_run(session: Session, run: RunDir, state: dict[str, Any]) -> None:
    """Make the run directory that of the checkpoint `state` a resumed run starts from, as a cut anywhere in
    writing it may have left it: metrics.jsonl up to the checkpoint's epoch (its line from the checkpoint when the
    cut came first), the method's events and topology, and the best checkpoint when it is this one."""
    run.truncate_metrics(session.epoch)
    logged = run.metrics()
    if state.get("record") is not None and (not logged or logged[-1]["epoch"] < session.epoch):
        run.append_metrics(state["record"])
    write_width_log(session.method, run)
    if session.best_epoch == session.epoch:
        try:
            load_checkpoint(run.best)
        except CheckpointError as e:
            warnings.warn(f"{e}; the best checkpoint is this epoch's: copied from {state['path']}", stacklevel=3)
            run.copy_checkpoint(state["path"], run.best)


def write_width_log(method: TrainingMethod, run: RunDir) -> None:
    """events.jsonl and topology.json of a method that changes the model's widths (BARTER); nothing otherwise."""
    topology = method.topology()
    if topology is not None:
        run.write_events(method.events)
        run.write_json("topology.json", topology)


def check_compatible(saved: dict[str, Any], config: TrainConfig, ignore: frozenset[str]) -> None:
    """Raise CheckpointError unless the checkpoint's config equals `config` outside `ignore`."""
    current = config.to_dict()
    diffs = [f"{k}={saved.get(k)!r} in the checkpoint, {v!r} now" for k, v in current.items()
             if k not in ignore and saved.get(k) != v]
    if diffs:
        raise CheckpointError("checkpoint made with another configuration: " + "; ".join(diffs))


def restore(session: Session, state: dict[str, Any]) -> None:
    """Load a checkpoint into a freshly built session (the method first: BARTER restores the saved widths)."""
    try:
        session.method.load_state_dict(state[session.method.state_key])
        if is_sharded(session.model):
            load_shards(session, state["path"])
        else:
            session.model.load_state_dict(state["model"] if session.ema is None else state["live_model"])
            if session.ema is not None:
                session.ema.load_state_dict(state["model_ema"])
            session.optimizer.load_state_dict(state["optimizer"])
        session.meter.load_state_dict(state["flops"])
        session.precision.load_state_dict(state["scaler"])
        session.schedule = WarmupCosine(**state["schedule"])
        session.epoch, session.step, session.finished = state["epoch"], state["step"], state["finished"]
        session.best_acc, session.best_epoch = state["best"]["acc"], state["best"]["epoch"]
        session.step_flops, session.wall_s = state["step_flops"], state["wall_s"]
        set_rng_state(state["rng"])
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"checkpoint does not fit this run ({type(e).__name__}: {e})") from e


def save_checkpoints(session: Session, config: TrainConfig, data: Data, run: RunDir, improved: bool, *,
                     record: dict[str, Any]) -> None:
    """Export the model (its EMA under `model_ema`) to the run's last checkpoint with the trainer state and the
    epoch's metrics `record` beside it (`barter.training.runlog`), and copy it to the best one when it improved:
    `barter.load(run / "best")` gives the selected model. Under `fsdp`: `save_sharded_checkpoints`."""
    if config.fsdp:
        save_sharded_checkpoints(session, config, data, run, improved, record=record)
        return
    exported = session.model if session.ema is None else session.ema.module
    state = {**checkpoint_state(session, config), "record": record}
    run.save_checkpoint(exported, state, architecture=config.model,
                        model_kwargs=model_arguments(config, data),
                        example_inputs=example_batch(data, torch.device("cpu")))
    if improved:
        run.copy_checkpoint(run.last, run.best)


def save_sharded_checkpoints(session: Session, config: TrainConfig, data: Data, run: RunDir, improved: bool, *,
                             record: dict[str, Any]) -> None:
    """The checkpoints of an FSDP2 run (collective: every rank calls). Every rank writes its shards of the model
    and the optimizer state through `torch.distributed.checkpoint`; rank 0 gathers the whole model, exports it
    (`barter.load(run / "best")` works as for any run) with the trainer state, and moves the shards in beside
    them: the checkpoint directory is both an export and a DCP checkpoint, every file in its manifest."""
    shards = run.path / SHARDS_STAGING
    if processes.is_main():
        shutil.rmtree(shards, ignore_errors=True)
    processes.barrier()
    model_state, optimizer_state = get_state_dict(session.model, session.optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=shards)
    whole = get_model_state_dict(session.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if processes.is_main():
        counts = session.method.state_dict().get("topology", {})  # {group name: units}; none for a dense model
        # the unsharded copy is built afresh and analysed again (`barter_base` keeps the analysis without its install
        # plan, whose graphs hold a whole copy of the model): about 2 s for a ViT-S on one CPU core, beside some 5 s
        # for the export itself, once a checkpoint. Keeping a resized copy between checkpoints would keep the whole
        # model on rank 0 for the whole run, which sharding is there to avoid
        fresh = build_model(config.model, model_arguments(config, data), None)
        exported = whole_copy(session.model, fresh, counts, whole)
        state = {**checkpoint_state(session, config), "record": record}

        def fill(directory: Path) -> None:
            write_export(exported, directory, architecture=config.model, model_kwargs=model_arguments(config, data),
                         example_inputs=example_batch(data, torch.device("cpu")))
            torch.save(state, directory / TRAINER_STATE)
            for file in shards.iterdir():
                os.replace(file, directory / file.name)

        replace_directory(run.last, fill, keep=run.previous)
        shutil.rmtree(shards, ignore_errors=True)
        if improved:
            run.copy_checkpoint(run.last, run.best)
    processes.barrier()


def load_shards(session: Session, path: Path) -> None:
    """Load the model's and the optimizer's shards of an FSDP2 checkpoint at `path` into a session whose model
    has the saved widths already (collective)."""
    model_state, optimizer_state = get_state_dict(session.model, session.optimizer)
    dcp.load({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=path)
    set_state_dict(session.model, session.optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)


def save_compact(session: Session, config: TrainConfig, data: Data, run: RunDir) -> int | None:
    """Export the selected model (the best checkpoint) to `run.compact` when its method ships a smaller model than
    it trains (S²ViTE removes its dead units), so that `barter.load(run / "compact")` gives it as it gives BARTER's
    checkpoints; return its parameter count, or None when there is nothing smaller to write."""
    best = load_checkpoint(run.best)
    device = next(session.model.parameters()).device
    compact = session.method.export(best["model"], best[session.method.state_key], example_batch(data, device))
    if compact is None:
        return None
    export(compact, run.compact, example_inputs=example_batch(data, torch.device("cpu")), architecture=config.model,
           model_kwargs=model_arguments(config, data))
    return sum(p.numel() for p in compact.parameters())


def checkpoint_state(session: Session, config: TrainConfig) -> dict[str, Any]:
    """What resuming needs besides the exported weights: optimizer and method states (the method's under its
    `state_key`), FLOP meter, counters, learning-rate schedule, best result, random states and the config; under
    `model_ema` the exported weights are the EMA's, so the live model's and the EMA's whole states are here too."""
    state = {
        "config": config.to_dict(), "epoch": session.epoch, "step": session.step, "finished": session.finished,
        "schedule": asdict(session.schedule),
        "optimizer": None if config.fsdp else session.optimizer.state_dict(),  # FSDP2: in the checkpoint's shards
        session.method.state_key: session.method.state_dict(),
        "flops": session.meter.state_dict(), "scaler": session.precision.state_dict(),
        "step_flops": session.step_flops, "wall_s": session.wall_s,
        "best": {"acc": session.best_acc, "epoch": session.best_epoch}, "rng": rng_state(),
    }
    if session.ema is not None:
        state.update(live_model=session.model.state_dict(), model_ema=session.ema.state_dict())
    return state


def rng_state() -> dict[str, Any]:
    """torch (CPU and CUDA), NumPy and Python random states, in types `torch.load(weights_only=True)` reads."""
    _, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "numpy": {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": pos, "has_gauss": has_gauss,
                      "gauss": gauss},
            "python": random.getstate()}


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    np_state = state["numpy"]
    np.random.set_state(("MT19937", np_state["keys"].numpy().astype(np.uint32), np_state["pos"],
                         np_state["has_gauss"], np_state["gauss"]))
    random.setstate(state["python"])


def seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)
