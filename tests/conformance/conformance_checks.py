"""Conformance of `barter.wrap` on a model: the test oracle behind `tests/conformance/test_conformance.py` and
`benchmarks/conformance.py`.

For one model: analysis finds groups (or says what it leaves out and why); every exact group's clone
leaves the outputs unchanged and its removal (above its minimum count) equals masking the unit's output slices,
and equals zeroing the unit's activations through the public ``tap`` (a second oracle, float64; the tap sees a
unit at every point it enters the others: the output projection's input and any head-mixing map's); train()
(same seed) and eval()
behave like the original; and a short training run with transfers stays finite, its scores non-zero in every
layer at its end (the taps ran).
"""
from __future__ import annotations

import copy
import functools
import importlib
import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch import nn
from torch.utils import _pytree as pytree

from barter import wrap
from fxsurgery import Analysis, Surgeon, analyse

LIST = Path(__file__).resolve().parent / "timm_models.json"  # the project's copy of the list


@dataclass
class Conformance:
    """What the checks found for one model."""

    model: str
    heads: int = 0
    channels: int = 0
    exact: int = 0
    left_out: list[str] = field(default_factory=list)
    clone_ok: bool = False
    remove_ok: bool = False
    tap_ok: bool = False
    scores_ok: bool = False
    modes_ok: bool = False
    train_ok: bool = False
    transfers: int = 0
    analyse_s: float = 0.0
    unaccounted: list[str] = field(default_factory=list)  # attention/FFN modules neither grouped nor reported
    error: str = ""

    @property
    def passed(self) -> bool:
        """Every check holds, and every attention and FFN module has a group or is reported as left out."""
        found = self.channels > 0 and not self.unaccounted
        return (not self.error and found and self.clone_ok and self.remove_ok and self.tap_ok and self.modes_ok
                and self.train_ok and self.scores_ok)


# The oracle's notion of an attention or FFN module, from timm's class names (fxsurgery itself never
# looks at names): each such module, outermost only, must host a group of its kind or be reported.
# Classifier heads (an MLP head such as NormMlpClassifierHead) are not FFN layers, and a module without parameters
# (Funnel's FunnelAttentionStructure, which computes position tables) holds no unit.
UNIT_MODULES = {"head": re.compile(r"Att(n|ention)|^(XCA|MHSA|GPSA)$"),
                "channel": re.compile(r"Mlp|MLP|FeedForward|^FFN|GLU")}


def unaccounted_modules(model: nn.Module, surgeon: Surgeon) -> list[str]:
    """`kind: module` for every attention/FFN module of `model` with no group of that kind at or under it (or
    hosted above it and slicing its parameters: a block that holds the heads' position-bias table hosts them)
    and no left-out report at, under, or (below the root) above it."""
    out, claimed = [], []
    for name, module in model.named_modules():
        for kind, pattern in UNIT_MODULES.items():
            cls = type(module).__name__
            if not name or not pattern.search(cls) or cls.endswith("Head") or any(_within(name, c) for c in claimed):
                continue
            if next(module.parameters(), None) is None:
                continue
            claimed.append(name)
            grouped = any(g.kind == kind and (_within(g.module, name) or any(_within(sl.name, name) for sl in g.slices))
                          for g in surgeon.groups)  # a group over several layers (a shared bias) slices each
            reported = any(_within(lo.module, name) or (lo.module and _within(name, lo.module))
                           for lo in surgeon.left_out)
            if not (grouped or reported):
                out.append(f"{kind}: {name} ({cls})")
    return out


def _within(name: str, ancestor: str) -> bool:
    return name == ancestor or name.startswith(ancestor + ".")


def outputs(y: object) -> list[torch.Tensor]:
    """The floating-point tensors of a model's output (a tensor, a tuple, or a structured output such as
    Hugging Face's ModelOutput)."""
    return [t for t in pytree.tree_leaves(y) if torch.is_tensor(t) and t.is_floating_point()]


def _close(a: object, b: object, tol: float) -> bool:
    a, b = outputs(a), outputs(b)
    return [t.shape for t in a] == [t.shape for t in b] and all(
        bool((x - y).abs().max() <= tol * max(1.0, float(y.abs().max()))) for x, y in zip(a, b) if x.numel())


def training_loss(out: object, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy on class logits; for models that return features (hidden states, a pooled output), the
    mean square of every one, so each layer that makes one is trained and scored."""
    first = outputs(out)[0]
    if first.dim() == 2:
        return nn.functional.cross_entropy(first, y % first.shape[1])
    return sum(t.float().square().mean() for t in outputs(out))


def in_float64(model: nn.Module, x: torch.Tensor) -> tuple[nn.Module, torch.Tensor]:
    """A float64 copy of ``model`` in eval mode and ``x`` in float64 (token ids stay integers): the oracle's
    tolerances are float64's."""
    return copy.deepcopy(model).double().eval(), x.double() if x.is_floating_point() else x


def check_analysis(model: nn.Module, x: torch.Tensor, result: Conformance) -> tuple[Surgeon, Analysis]:
    """The analysis of ``model`` (never called before: analysed as a user wraps it), installed on it: its group counts,
    what it leaves out, the attention and FFN modules neither grouped nor reported, and its seconds."""
    t = time.perf_counter()
    analysis = analyse(model, (x,))
    s = Surgeon(model, analysis)
    result.analyse_s = time.perf_counter() - t
    result.heads = sum(g.kind == "head" for g in s.groups)
    result.channels = sum(g.kind == "channel" for g in s.groups)
    result.exact = sum(g.exact for g in s.groups)
    result.left_out = [f"{lo.module}: {'; '.join(lo.reasons)}" for lo in s.left_out]
    result.unaccounted = unaccounted_modules(model, s)
    return s, analysis


def check_surgery(model: nn.Module, x: torch.Tensor, result: Conformance) -> None:
    """In float64: cloning unit 0 of every exact group leaves the outputs unchanged; removing it
    (on a fresh copy) equals the original with that unit's output slices zeroed (its projection columns, and its
    rows of any head-mixing map)."""
    model, x = in_float64(model, x)
    original = copy.deepcopy(model)
    s, analysis = check_analysis(model, x, result)
    fresh, masked = copy.deepcopy(original), copy.deepcopy(original)  # before train mode moves BN statistics
    with torch.no_grad():
        result.modes_ok = True
        for mode in ("train", "eval"):  # same seed, same dropout and drop-path draws
            getattr(model, mode)()
            getattr(original, mode)()
            torch.manual_seed(1)
            a = model(x)
            torch.manual_seed(1)
            b = original(x)
            # the same dropout draws in training (another draw differs by O(1), not by rounding); products
            # grouped differently (nn.MultiheadAttention's cross-attention, its fused inference path) round apart
            result.modes_ok &= _close(a, b, 1e-12)
        y0 = model(x)
        gen = torch.Generator().manual_seed(0)
        for g in s.groups:
            if g.exact:
                s.clone(g, 0, noise_std=0.1, generator=gen, relative=True)
        result.clone_ok = _close(model(x), y0, 1e-9)
        s2 = Surgeon(fresh, analysis)  # a copy built alike takes the same analysis, as a user's second model does
        exact = [g for g in s2.groups if g.exact and g.count > g.min_count]  # a group at its minimum keeps its units
        taps = [s2.tap(g, _zero_first_unit) for g in exact]
        by_taps = fresh(x)
        for handle in taps:
            handle.remove()
        params = dict(masked.named_parameters())
        for g in exact:  # all before any removal: a removal moves the segments of groups sharing its tensors
            _zero_first_unit_at(params, g, [sl for sl in g.slices if sl.output])
        for g in exact:
            s2.remove(g, 0)
        removed = fresh(x)
        result.remove_ok = _close(removed, masked(x), 1e-9)
        result.tap_ok = _close(by_taps, removed, 1e-9)


def _zero_first_unit(a: torch.Tensor) -> None:
    a[..., 0, :] = 0


def _zero_first_unit_at(params: dict[str, torch.Tensor], g, slices: list) -> None:
    """Zero unit 0 of ``slices`` (every output slice: every point where the unit enters the others)."""
    for sl in slices:
        sl.unit(params[sl.name].data, g.count, 0).zero_()


def check_training(model: nn.Module, x: torch.Tensor, result: Conformance, steps: int = 6) -> None:
    """A short BARTER run whose window holds several transfers: every loss finite."""
    model = copy.deepcopy(model).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ctl = wrap(model, opt, total_steps=steps, density=0.5, example_inputs=(x,), window=(0.1, 0.9))
    y = torch.randint(0, 2, (x.shape[0],))
    ok = True
    for _ in range(steps):
        opt.zero_grad()
        loss = training_loss(model(x), y)
        loss.backward()
        opt.step()
        ok &= bool(torch.isfinite(loss))
    # every layer with units of a kind with transfers was scored (a zero-initialised classifier passes no gradient
    # at the first step; a kind of one layer has no transfers, so nothing scores it)
    result.scores_ok = all(float(d.abs().sum()) > 0 and float(s.abs().sum()) > 0
                           for kind in ("head", "channel") if ctl.schedule[kind]
                           for d, s in ctl.scores(kind).values() if d.numel())
    result.transfers = sum(e["skipped"] is None for e in ctl.events)
    result.train_ok = ok and result.transfers > 0


def check(name: str, build: Callable[[], nn.Module], x: torch.Tensor, *, analysis_only: bool = False) -> Conformance:
    """All checks for one model (with ``analysis_only``, its analysis alone: the group counts a table states); an
    exception is recorded, not raised. The model is built here and never called before it is analysed."""
    result = Conformance(name)
    try:
        torch.manual_seed(0)
        model = build()
        if analysis_only:
            check_analysis(*in_float64(model, x), result)
            return result
        check_surgery(model, x, result)
        check_training(model, x, result)
    except Exception as e:  # the table must go on; the error is the finding
        result.error = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return result


def model_cases(path: Path = LIST, depth: int | None = 2) -> list[tuple[str, Callable[[], nn.Module], torch.Tensor]]:
    """A JSON list as (name, builder, input). An entry names a timm model (``depth`` shrinks models that
    take it) or, with ``"factory": "module:callable"`` and ``"input": [C, H, W]``, any other constructor;
    ``"tokens": V`` makes the input token ids below V of shape ``"input"`` (text models). Entries with a
    ``"skip"`` reason are not cases (`skipped` lists them)."""
    cases = []
    for entry in json.loads(path.read_text()):
        if "skip" in entry:
            continue
        kw = dict(entry["kwargs"])
        if "factory" in entry:
            module, _, attr = entry["factory"].partition(":")
            build = functools.partial(getattr(importlib.import_module(module), attr), **kw)
            shape = tuple(entry["input"])
        else:
            build = functools.partial(timm_model, entry["model"], kw, depth)
            size = kw.get("img_size", 224)
            shape = tuple(entry.get("input", (3, size, size)))
        x = torch.randint(0, entry["tokens"], (2, *shape)) if "tokens" in entry else torch.randn(2, *shape)
        cases.append((entry["model"], build, x))
    return cases


def skipped(path: Path) -> list[tuple[str, str]]:
    """(model, reason) for the entries of a JSON list that cannot be built here."""
    return [(entry["model"], entry["skip"]) for entry in json.loads(path.read_text()) if "skip" in entry]


def timm_model(name: str, kw: dict, depth: int | None) -> nn.Module:
    """A timm model with 2 classes and no weights, at ``depth`` where the model takes it and ``kw`` sets none."""
    from barter.rebuild import timm_with_models

    timm = timm_with_models()
    if depth:
        try:
            return timm.create_model(name, pretrained=False, num_classes=2, **{"depth": depth, **kw})
        except (TypeError, ValueError):  # depth given per stage, or not at all
            pass
    return timm.create_model(name, pretrained=False, num_classes=2, **kw)
