"""`barter.wrap`: analyse a model, shrink it to density rho, and return the controller that trains it."""
from __future__ import annotations

import warnings
import weakref
from typing import Any, NamedTuple

import torch
from fxsurgery import Surgeon, UnitGroup
from torch import nn

from .compact import compact
from .controller import Controller
from .options import Options
from .schedule import KINDS, make_schedule, transfer_count
from .selection import METHODS


class UnitAnalysis(NamedTuple):
    """The unit groups of a model as barter first analysed it, and the example inputs they were found with."""

    groups: list[UnitGroup]
    example_inputs: tuple


# weak keys: the groups hold names, layouts and counts, not the model, so an entry dies with its model
_ANALYSES: weakref.WeakKeyDictionary[nn.Module, UnitAnalysis] = weakref.WeakKeyDictionary()


def record_analysis(surgeon: Surgeon) -> None:
    """Remember `surgeon`'s groups for its model, so `barter.export` can tell the model's topology later.

    The first analysis wins: it describes the model as built (every group at its maximum), which a later
    analysis of the resized model cannot (a layer left with one head or none is no group there).
    """
    _ANALYSES.setdefault(surgeon.model, UnitAnalysis(surgeon.groups, surgeon.example_inputs))


def recorded_analysis(model: nn.Module) -> UnitAnalysis | None:
    """The first analysis `wrap` or `barter.load` made of `model`, or None for another model."""
    return _ANALYSES.get(model)


def default_example_inputs(model: nn.Module) -> tuple[torch.Tensor]:
    """A zero batch of two images shaped like a timm model's `pretrained_cfg["input_size"]`.

    timm keeps the registry's input size in `pretrained_cfg` even when a ViT is built with another
    `img_size`, so the patch embedding's `img_size`, where present, wins.
    """
    cfg = getattr(model, "pretrained_cfg", None) or {}
    if "input_size" not in cfg:
        raise ValueError("example_inputs is required for a model without timm's pretrained_cfg['input_size']")
    c, h, w = cfg["input_size"]
    size = getattr(getattr(model, "patch_embed", None), "img_size", None)
    if size is not None:
        h, w = size
    p = next(model.parameters())
    return (torch.zeros(2, c, h, w, dtype=p.dtype, device=p.device),)


def wrap(model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, total_steps: int,
         density: float = 0.5, example_inputs: tuple | None = None, method: str = "barter", seed: int = 0,
         auto: bool = True, **options: Any) -> Controller:
    """Make `model` compact in place (n_l,0 units per layer) and return its BARTER controller.

    method: "barter", "static" (never transfers), "random_receiver", "random_donor" or "random_pair".
    options: see `barter.options.Options` (beta, window, head_ratio, channel_ratio, noise_std,
    noise_relative, init). An optimizer passed here (made before wrap) is attached before the model shrinks;
    one made later goes through `ctl.attach_optimizer`. With `auto`, transfers run from the optimizer's
    post-step hook; otherwise call `ctl.step()` right after every `optimizer.step()`.
    To resume, wrap a freshly built model with the same arguments, then call `ctl.load_state_dict(sd)` before
    `model.load_state_dict` and `optimizer.load_state_dict` (it restores the saved widths first).
    """
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; expected one of {METHODS}")
    if not 0 < density <= 1:
        raise ValueError(f"density must be in (0, 1], got {density}")
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    opts = Options.from_kwargs(**options)
    surgeon = Surgeon(model, example_inputs=tuple(example_inputs or default_example_inputs(model)))
    record_analysis(surgeon)
    layers = {kind: [g for g in surgeon.groups if g.kind == kind and g.exact] for kind in KINDS}
    inexact = [g.name for g in surgeon.groups if not g.exact]
    if inexact:
        warnings.warn(f"barter keeps these unit groups dense and fixed, their surgery is not exact: {inexact}")
    if optimizer is not None:
        surgeon.attach_optimizer(optimizer)
    select_rng = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    noise_rng = torch.Generator(device=device).manual_seed(seed)
    counts = {kind: compact(surgeon, layers[kind], density, opts.init, select_rng, surgeon.unit_norms)
              for kind in KINDS}
    ratio = {"head": opts.head_ratio, "channel": opts.channel_ratio}
    budgets = {
        kind: 0 if method == "static" else transfer_count(sum(counts[kind]), ratio[kind], _feasible(layers[kind]))
        for kind in KINDS
    }
    ctl = Controller(surgeon, layers, make_schedule(total_steps, budgets, opts.window), method=method, auto=auto,
                     options=opts, select_rng=select_rng, noise_rng=noise_rng)
    if optimizer is not None:
        ctl.follow_optimizer(optimizer)
    return ctl


def _feasible(groups: list) -> bool:
    """A kind can transfer if at least two layers carry it and some layer could grow."""
    return len(groups) >= 2 and any(g.count < g.max_count for g in groups)
