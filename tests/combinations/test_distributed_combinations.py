"""Features in combination over processes: the combination matrix's models, widths and lifecycle steps
(test_combination_matrix.py) on two gloo processes (forked, CPU) under DDP (`barter.DistributedModel`) and under
FSDP2 (`barter.fsdp.shard`: each block, then the root), each process on its share of every global batch.

A run trains through BARTER's transfers and takes its lifecycle step: checkpoint -> resume (under FSDP2 each process
writes and reads its shards of the model and the optimizer through torch.distributed.checkpoint), or export -> load
(rank 0's export of the whole model, gathered under FSDP2; a transformers model's `save_pretrained` folder too).
Before the export it forces a drawn layer to its edge on the live model, on every process alike, and trains one more
step: a layer that may lose every head loses them when the model has one (FSDP2 then gathers it empty and must
reduce no gradient for it), else one keeps its last unit.

Properties: training stays finite; the scores are non-zero in every layer with units while they are collected; the
processes log the same events and hold identical parameters; a resumed run ends equal to the uninterrupted one; the
export loads equal; the run equals one process on the same global batches: the same decisions, the parameters and
the outputs within 1e-5.

CI runs a fixed slice: every model, width and lifecycle step, checkpoint -> resume and export -> load under both
runtimes, and layers emptied of heads under FSDP2 (the ViT's by a transfer before its checkpoint and by the forced
edge, the head-mixing model's by the forced edge before its export, Phi-3's, in pieces of its fused q/k/v
projection, by the forced edge before its export); `make soak` runs every combination, each with a
freshly drawn seed.
"""
from __future__ import annotations

import copy
import itertools
import random
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from cases import BATCH, CASES, Batch
from event_checks import assert_same_events
from forked import WORLD, fork_processes, load_ranks
from hypothesis import given, settings
from hypothesis import strategies as st
from test_combination_matrix import (
    LIFECYCLES,
    OPTIONS,
    RESUME_AT,
    STEPS,
    WIDTHS,
    Run,
    assert_export_loads_equal,
    assert_scores_nonzero,
    outputs,
)
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import barter
from barter.fsdp import gathered_state_dict, shard, sharded_access, whole_copy
from barter.training import processes

DISTRIBUTED = ("ddp", "fsdp2")
PROBE_STEP = STEPS + 1  # the batch the outputs are compared on


@dataclass(frozen=True)
class Combination:
    """One value of each axis, and the seed that draws the layer forced to its edge."""

    model: str
    runtime: str  # "eager" for the one process the distributed runs are compared with
    width: str
    lifecycle: str
    seed: int


def wrap(combination: Combination) -> barter.Controller:
    """The controller of the combination's model, freshly built and wrapped: what each run starts from (a copy of
    it, in its process), so that the model is analysed once for all of them."""
    case = CASES[combination.model]
    torch.manual_seed(0)
    args, kwargs, _ = case.batch(0)
    return barter.wrap(case.build(), total_steps=STEPS, density=WIDTHS[combination.width], example_inputs=args,
                       example_kwargs=kwargs, auto=False, **OPTIONS)


def start(combination: Combination, wrapped: barter.Controller, controller_state: dict | None = None) -> Run:
    """A copy of the freshly wrapped model laid out in the combination's runtime on this process; with
    `controller_state`, brought to the saved widths before it is sharded (as a resume starts)."""
    ctl = copy.deepcopy(wrapped)
    model = ctl.model
    use_running_statistics(model)
    if controller_state is not None:
        ctl.load_state_dict(controller_state)
    if combination.runtime == "fsdp2":
        shard(model)
    # SGD: Adam would turn the float noise in a key bias's gradient, which is zero, into steps of +-lr that differ
    # between the runtimes
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ctl.attach_optimizer(optimizer)
    forward = barter.DistributedModel(model, ctl) if combination.runtime == "ddp" else model
    return Run(CASES[combination.model], combination.runtime, model, optimizer, ctl, forward, ema=None)


def use_running_statistics(model: nn.Module) -> None:
    """Batch norms normalise by their running statistics: those of one process's share of a batch are not the
    whole batch's."""
    for module in model.modules():
        if isinstance(module, (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)):
            module.eval()


def share(batch: Batch) -> Batch:
    """This process's rows of every tensor of a global batch."""
    rows = processes.shard(range(BATCH))
    args, kwargs, target = batch

    def mine(value):
        return value[rows] if torch.is_tensor(value) else value
    return tuple(map(mine, args)), {k: mine(v) for k, v in kwargs.items()}, mine(target)


def train(run: Run, steps: range, checkpoint_at: int | None = None, shards: Path | None = None) -> dict | None:
    """Train `steps` on this process's shares, the controller stepping through the scheduled steps; returns the
    checkpoint taken after `checkpoint_at` steps, if any."""
    checkpoint = None
    for step in steps:
        if step == checkpoint_at:
            checkpoint = save(run, shards)
        args, kwargs, target = share(run.case.batch(step))
        loss = run.case.loss(run.forward(*args, **kwargs), target)
        assert torch.isfinite(loss), f"step {step}: loss {loss.item()}"
        loss.backward()
        run.optimizer.step()
        run.optimizer.zero_grad()
        if step < STEPS:
            assert_scores_nonzero(run)
            run.controller.step()
    return checkpoint


def save(run: Run, shards: Path) -> dict:
    """A training checkpoint: the controller's state, and the model's and the optimizer's (under FSDP2 each
    process writes its shards of them to `shards`)."""
    saved = {"controller": copy.deepcopy(run.controller.state_dict())}
    if run.runtime == "fsdp2":
        model_state, optimizer_state = get_state_dict(run.model, run.optimizer)
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=shards)
    else:
        saved.update(model=copy.deepcopy(run.model.state_dict()), optimizer=copy.deepcopy(run.optimizer.state_dict()))
    return saved


def resume(combination: Combination, wrapped: barter.Controller, saved: dict, shards: Path) -> Run:
    """A freshly wrapped run restored from `saved` (and its shards under FSDP2), the controller first."""
    run = start(combination, wrapped, controller_state=saved["controller"])
    if run.runtime == "fsdp2":
        model_state, optimizer_state = get_state_dict(run.model, run.optimizer)
        dcp.load({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=shards)
        set_state_dict(run.model, run.optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)
    else:
        run.model.load_state_dict(saved["model"])
        run.optimizer.load_state_dict(saved["optimizer"])
    return run


def force_edge(run: Run, rng: random.Random) -> None:
    """Remove every removable unit of a drawn layer from the live model: one whose heads may all go when the model
    has one, else any (it keeps one unit)."""
    ctl = run.controller
    removable = [g for g in ctl.surgeon.groups if g.exact and g.count > g.min_count]
    if not removable:
        return
    emptiable = [g for g in removable if g.kind == "head" and g.min_count == 0]
    group = rng.choice(emptiable or removable)
    gone = rng.sample(range(group.count), group.count - group.min_count)
    access = sharded_access(run.model)  # None unless FSDP2 shards the model
    if access is not None:
        ctl.surgeon.set_tensor_access(access)
    ctl.surgeon.keep(group, [u for u in range(group.count) if u not in gone])
    ctl.edits += 1  # an edit of the model: DistributedModel rebuilds its reducer before the next forward


def export(run: Run, directory: Path) -> None:
    """Rank 0 exports the whole model (gathered from the shards under FSDP2), which equals the live model and
    loads equal."""
    whole = gathered_state_dict(run.model) if run.runtime == "fsdp2" else None  # collective
    live = outputs(run, run.model, PROBE_STEP)
    if processes.is_main():
        if whole is not None:
            counts = {g.name: g.count for g in run.controller.surgeon.groups}
            run = replace(run, model=whole_copy(run.model, run.case.build(), counts, whole))
            use_running_statistics(run.model)
        for a, e in zip(outputs(run, run.model, PROBE_STEP), live, strict=True):
            torch.testing.assert_close(a, e, rtol=0, atol=1e-5, msg="the exported model against the live one")
        assert_export_loads_equal(run, run.model, directory)


def play(combination: Combination, wrapped: barter.Controller, directory: Path) -> dict:
    """Train the combination on this process, take its lifecycle step, force a layer to its edge and train one
    more step; returns the events, the whole parameters and the outputs."""
    run = start(combination, wrapped)
    resuming = combination.lifecycle == "checkpoint_resume"
    shards = directory / "shards"
    saved = train(run, range(STEPS), checkpoint_at=RESUME_AT if resuming else None, shards=shards)
    if resuming:
        resumed = resume(combination, wrapped, saved, shards)
        train(resumed, range(RESUME_AT, STEPS))
        assert resumed.controller.events == run.controller.events
        uninterrupted = gathered_state_dict(run.model)
        for name, tensor in gathered_state_dict(resumed.model).items():
            assert torch.equal(tensor, uninterrupted[name]), f"{name} differs after the resume"
        run = resumed
    force_edge(run, random.Random(combination.seed))
    train(run, range(STEPS, STEPS + 1))
    if combination.lifecycle == "export_load":
        export(run, directory / "export")
    return {"events": run.controller.events, "params": gathered_state_dict(run.model),
            "outputs": outputs(run, run.model, PROBE_STEP)}


def worker(rank: int, directory: Path, combination: Combination, wrapped: barter.Controller) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{directory / 'init'}", rank=rank, world_size=WORLD,
                            timeout=timedelta(minutes=2))  # a divergence fails instead of hanging
    try:
        torch.save(play(combination, wrapped, directory), directory / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def alone_worker(rank: int, directory: Path, combination: Combination, wrapped: barter.Controller) -> None:
    """The run on one process, without torch.distributed."""
    torch.set_num_threads(1)
    torch.save(play(combination, wrapped, directory), directory / "alone.pt")


def check_distributed(tmp_path_factory, combination: Combination) -> list[dict]:
    """Run the combination on WORLD processes; they agree with each other bitwise and with one process. Returns
    the events."""
    directory = tmp_path_factory.mktemp("processes")
    wrapped = wrap(combination)
    fork_processes(worker, directory, combination, wrapped)
    ranks = load_ranks(directory)
    first = ranks[0]
    for other in ranks[1:]:
        assert other["events"] == first["events"]
        assert other["params"].keys() == first["params"].keys()
        for name, tensor in first["params"].items():
            assert torch.equal(other["params"][name], tensor), f"{name} differs between the processes"
    alone_directory = tmp_path_factory.mktemp("alone")
    fork_processes(alone_worker, alone_directory, replace(combination, runtime="eager", lifecycle="transfers"),
                   wrapped, processes=1)
    alone = torch.load(alone_directory / "alone.pt", weights_only=False)
    assert_same_events(first["events"], alone["events"])
    assert first["params"].keys() == alone["params"].keys()
    for name, tensor in alone["params"].items():
        torch.testing.assert_close(first["params"][name], tensor, rtol=0, atol=1e-5, msg=name)
    for a, e in zip(first["outputs"], alone["outputs"], strict=True):
        torch.testing.assert_close(a, e, rtol=0, atol=1e-5, msg="the outputs against one process")
    return first["events"]


# together with test_combination_matrix.py's examples, every value of every axis
CI_SLICE = [
    Combination("timm_vit", "fsdp2", "one_unit", "checkpoint_resume", seed=0),
    Combination("hf_encoder", "ddp", "maximum", "checkpoint_resume", seed=1),
    Combination("hf_decoder_cache", "ddp", "half", "export_load", seed=2),
    Combination("head_mixing", "fsdp2", "half", "export_load", seed=3),
    Combination("conv_ffn", "fsdp2", "maximum", "transfers", seed=4),
    Combination("hf_fused_gqa_cache", "fsdp2", "half", "export_load", seed=5),
    Combination("hf_alibi_cache", "fsdp2", "one_unit", "transfers", seed=8),
    Combination("hf_latent_cache", "ddp", "one_unit", "export_load", seed=10),
    Combination("hf_latent_cache", "fsdp2", "half", "checkpoint_resume", seed=11),
]


EVERY_COMBINATION = [Combination(*axes, seed=0) for axes in
                     itertools.product(sorted(CASES), DISTRIBUTED, sorted(WIDTHS), LIFECYCLES)]


def axes(combination: Combination) -> str:
    """A test id: the combination's value of each axis."""
    return f"{combination.model}-{combination.runtime}-{combination.width}-{combination.lifecycle}"


@pytest.mark.parametrize("combination", CI_SLICE, ids=axes)
def test_features_hold_over_processes(tmp_path_factory, combination):
    events = check_distributed(tmp_path_factory, combination)
    assert any(e["skipped"] is None for e in events) or combination.width == "maximum", "no transfer ran"


@pytest.mark.slow
@pytest.mark.parametrize("combination", EVERY_COMBINATION, ids=axes)
@settings(max_examples=1)
@given(seed=st.integers(0, 2**16))
def test_every_combination_over_processes(tmp_path_factory, combination, seed):
    check_distributed(tmp_path_factory, replace(combination, seed=seed))
