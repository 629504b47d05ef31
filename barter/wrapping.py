"""`barter.wrap`: analyse a model, shrink it to density rho, and return the controller that trains it."""
from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from fxsurgery import Surgeon, UnitKind, analyse

from .analysis import ModelBase, default_example_inputs, keep_base
from .calibration import Batch, LossFn, calibrated_scores
from .compact_init import compact
from .controller import Controller
from .fsdp import check_optimizer, refuse_sharded
from .loss_scale import Scaler
from .options import METHODS, RANKED_INITS, Options
from .pretrained import record_call, sampled_call
from .schedule import KINDS, make_schedule, transfer_count
from .transfer_policy import TransferParts

WRAPPED_ATTRIBUTE = "_barter_wrapped"  # set on a model `wrap` made compact: a second wrap is refused


def wrap(model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, total_steps: int,
         density: float = 0.5, example_inputs: tuple | None = None, example_kwargs: dict[str, Any] | None = None,
         method: str = "barter", seed: int = 0, auto: bool = True, scaler: Scaler | None = None,
         calibration: Iterable[Batch] | None = None, loss_fn: LossFn | None = None, **options: Any) -> Controller:
    """Make `model` compact in place (n_l,0 units per layer) and return its BARTER controller.

    example_inputs, example_kwargs: the call the model is analysed on, `model(*example_inputs, **example_kwargs)`,
    as training makes it (a model called with keyword arguments, like a Hugging Face one, needs example_kwargs);
    without either, a zero batch of a timm model's input size.
    method: "barter", "static" (never transfers), "random_receiver", "random_donor" or "random_pair".
    options: see `barter.options.Options` (beta, head_ratio, channel_ratio, noise_std, noise_relative, init,
    allocation, and the parts of a transfer: transfer_policy, transfer_parts, count_scale, window, clone_state,
    removal; `barter.transfer_policy`). calibration: the (inputs, targets) batches (a DataLoader) that init="score"
    measures each unit's D on, with `loss_fn(outputs, targets)` (default cross-entropy); `ctl.initial_units` says
    which units were kept. An optimizer passed here (made before wrap) is attached before the model shrinks;
    one made later goes through `ctl.attach_optimizer`. With `auto`, transfers run from the optimizer's
    post-step hook; otherwise call `ctl.step()` right after every `optimizer.step()` (or `scaler.step`).
    scaler: the `torch.amp.GradScaler` of fp16 training (also `ctl.track_scaler`): scores are unscaled by it.
    FSDP2: wrap the whole model first, then `fully_shard` it, then attach the optimizer built on the sharded
    parameters (`barter.fsdp`); a model sharded already is refused.
    To resume, wrap a freshly built model with the same arguments, then call `ctl.load_state_dict(sd)` before
    `model.load_state_dict` and `optimizer.load_state_dict` (it restores the saved widths first).
    """
    opts = _read_arguments(model, method=method, density=density, total_steps=total_steps, options=options,
                           calibration=calibration, loss_fn=loss_fn)
    if example_inputs is None and not example_kwargs:
        example_inputs = default_example_inputs(model)
    analysis = analyse(model, () if example_inputs is None else example_inputs, example_kwargs)
    # installed before the model records its base and call: both change its hosts' fingerprints (an attribute of
    # the model, a config its modules read), and a host changed since its analysis is analysed again
    surgeon = Surgeon(model, analysis)
    keep_base(model, ModelBase(analysis, architecture=None, model_kwargs={}, call=None))
    record_call(model, sampled_call(analysis.example_inputs, analysis.example_kwargs))
    model.__dict__[WRAPPED_ATTRIBUTE] = True
    layers = {kind: [g for g in surgeon.groups if g.kind == kind and g.exact] for kind in KINDS}
    inexact = [g.name for g in surgeon.groups if not g.exact]
    if inexact:
        warnings.warn(f"barter keeps these unit groups dense and fixed, their surgery is not exact: {inexact}",
                      stacklevel=2)
    if optimizer is not None:
        check_optimizer(model, optimizer)
        surgeon.attach_optimizer(optimizer)
    select_rng = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device  # a meta model's: the controller seeds it again where it runs
    noise_rng = torch.Generator(device="cpu" if device.type == "meta" else device).manual_seed(seed)
    scores = None if calibration is None else calibrated_scores(
        surgeon, [g for kind in KINDS for g in layers[kind]], calibration, loss_fn)
    kept = compact(surgeon, layers, density=density, init=opts.init, allocation=opts.allocation,
                   generator=select_rng, importance=surgeon.unit_norms if scores is None else lambda g: scores[g.name])
    budgets = _transfer_budgets(layers, method, opts)
    if opts.policy.transfer_parts is TransferParts.CLONES:
        budgets = {kind: _make_room(surgeon, layers[kind], kept, budgets[kind], opts.policy.minimum(kind))
                   for kind in KINDS}
    ctl = Controller(surgeon, layers, make_schedule(total_steps, budgets, opts.policy.window), method=method, auto=auto,
                     options=opts, select_rng=select_rng, noise_rng=noise_rng, initial_units=kept)
    if optimizer is not None:
        ctl.follow_optimizer(optimizer)
    ctl.track_scaler(scaler)
    return ctl


def _read_arguments(model: nn.Module, *, method: str, density: float, total_steps: int, options: dict[str, Any],
                    calibration: Iterable[Batch] | None, loss_fn: LossFn | None) -> Options:
    """`wrap`'s options, read after refusing what it cannot do, before it touches the model: an unknown method, a
    density or step count out of range, a sharded or wrapped model, calibration batches without init="score" or the
    other way round."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; expected one of {METHODS}")
    if not 0 < density <= 1:
        raise ValueError(f"density must be in (0, 1], got {density}")
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    opts = Options.from_kwargs(**options)
    refuse_sharded(model)
    if model.__dict__.get(WRAPPED_ATTRIBUTE):
        raise ValueError(f"{type(model).__name__} is wrapped by barter.wrap already (compact, its layers installed): "
                         "keep using the controller that wrap returned (ctl.close() stops it following the "
                         "optimizer and collecting scores); to wrap anew, build the model afresh and wrap that")
    if opts.init in RANKED_INITS and any(p.is_meta for p in model.parameters()):
        raise ValueError(f"init={opts.init!r} ranks units by their weights, and {type(model).__name__} is on the meta "
                         "device (no weights yet): wrap it with init='first' or 'random', or materialise and "
                         "initialise it first")
    if (opts.init == "score") != (calibration is not None):
        raise ValueError("init='score' measures D on calibration batches: pass calibration=<loader>"
                         if calibration is None else f"calibration is read by init='score' only (init={opts.init!r})")
    if loss_fn is not None and calibration is None:
        raise ValueError("loss_fn is the loss of the calibration batches: it needs calibration")
    return opts


def _transfer_budgets(layers: dict[UnitKind, list], method: str, options: Options) -> dict[UnitKind, int]:
    """How many transfers of each kind the schedule holds (the policy's count scale applied): none for "static" or a
    kind that cannot transfer."""
    counts = {kind: [g.count for g in layers[kind]] for kind in KINDS}
    scale = options.policy.count_scale
    ratio = {UnitKind.HEAD: options.head_ratio * scale, UnitKind.CHANNEL: options.channel_ratio * scale}
    return {
        kind: 0 if method == "static" else transfer_count(sum(counts[kind]), ratio[kind], _feasible(layers[kind]))
        for kind in KINDS
    }


def _make_room(surgeon: Surgeon, groups: list, kept: dict[str, list[int]], clones: int, minimum: int) -> int:
    """Take up to `clones` units off `groups` before training, one at a time from the widest layer (its last unit;
    ties to the lower layer; none under `minimum`), so that clones-only transfers end at the width budget; returns
    how many came off (the clones to schedule). `kept` (units of the model as built, by group) loses them too."""
    taken = 0
    while taken < clones:
        room = [g.count - max(minimum, g.min_count) for g in groups]
        if not room or max(room) <= 0:
            break
        g = groups[room.index(max(room))]
        surgeon.remove(g, g.count - 1)
        if g.name in kept:
            kept[g.name] = kept[g.name][:-1]
        taken += 1
    return taken


def _feasible(groups: list) -> bool:
    """A kind can transfer if at least two layers carry it and some layer could grow."""
    return len(groups) >= 2 and any(g.count < g.max_count for g in groups)
