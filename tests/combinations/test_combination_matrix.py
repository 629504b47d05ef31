"""Features in combination: hypothesis draws one value of each axis, trains the drawn model through BARTER's
transfers in the drawn runtime, takes the drawn lifecycle step, and checks what must hold in every combination.

Axes: the model (`cases.CASES`: timm ViT, HF encoder, HF decoders with their cache (GPT-2, Phi-3's grouped-query
heads in a fused projection, Falcon's multi-query heads, Llama 4's complex-form rotary, MPT's ALiBi), heads mixed by
heads x heads maps, a convolutional FFN); the runtime (eager, torch.compile, bf16 autocast, an EMA copy tracked by
the controller); the width the layers start at (every layer at its maximum, at one unit, at half: a head transfer
then empties a layer of a model whose heads may all go, and fills its receiver to its maximum); the lifecycle step
(transfers alone, checkpoint -> resume, export -> load: barter's export and, for transformers models, the folder
`save_pretrained` writes). Every run ends by forcing a drawn layer to its edge (0 heads, or 1 channel) on a copy.

Properties: training stays finite; the scores are non-zero in every layer with units while they are collected;
every transfer and every forced edge equals masking the removed units, by two references built without fxsurgery's
slices (their output weights zeroed on a copy, and their activations zeroed through `tap` on a copy); a clone leaves
the outputs unchanged; the optimizer state and the EMA copy keep the parameters' shapes; a resumed run ends equal to
the uninterrupted one; an export loads equal, after the transfers and again at the forced edge.

CI runs the explicit examples (together every value of every axis) and a few drawn ones; `make soak` runs every
combination of the axes (tests/conftest.py prints the seed that replays a run). The runtimes that need two
processes, DDP and FSDP2, run these models, widths and lifecycle steps in test_distributed_combinations.py (in the
pass of `make test` that forks).
"""
from __future__ import annotations

import contextlib
import copy
import io
import itertools
import random
from dataclasses import dataclass

import pytest
import torch
from cases import CASES, Case
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import barter
from barter.compiling import compile_model

pytest.importorskip("timm")
transformers = pytest.importorskip("transformers")
from timm.utils import ModelEmaV3  # noqa: E402

RUNTIMES = ("eager", "compile", "amp_bf16", "ema")
WIDTHS = {"maximum": 1.0, "one_unit": 0.25, "half": 0.5}  # the density every layer starts at
LIFECYCLES = ("transfers", "checkpoint_resume", "export_load")
STEPS = 6
RESUME_AT = 3  # the step count at which the checkpoint is taken: after the first transfers
OPTIONS = {"window": (0.1, 0.9), "head_ratio": 1.0, "channel_ratio": 0.25, "noise_std": 0.01}
TOLERANCE = {"amp_bf16": 5e-2}  # relative to the outputs' scale; 1e-5 for float32


@dataclass
class Run:
    """A wrapped model in its runtime: `forward` is what training calls (the compiled model under compile)."""

    case: Case
    runtime: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    controller: barter.Controller
    forward: nn.Module
    ema: ModelEmaV3 | None


def start(case: Case, runtime: str, density: float) -> Run:
    torch.manual_seed(0)
    model = case.build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    args, kwargs, _ = case.batch(0)
    ctl = barter.wrap(model, optimizer, total_steps=STEPS, density=density, example_inputs=args,
                      example_kwargs=kwargs, auto=False, **OPTIONS)
    ema = None
    if runtime == "ema":
        ema = ModelEmaV3(model, decay=0.9)
        ctl.track(ema)
    forward = compile_model(model, ctl, backend="eager") if runtime == "compile" else model
    return Run(case, runtime, model, optimizer, ctl, forward, ema)


def autocast(runtime: str):
    return torch.autocast("cpu", dtype=torch.bfloat16) if runtime == "amp_bf16" else contextlib.nullcontext()


def outputs(run: Run, module: nn.Module, step: int) -> list[torch.Tensor]:
    """`module`'s outputs on the batch of `step`, without gradients, in the run's precision."""
    with torch.no_grad(), autocast(run.runtime):
        return [t.detach().float() for t in run.case.outputs(module, run.case.batch(step))]


def assert_close(run: Run, actual: list[torch.Tensor], expected: list[torch.Tensor], what: str) -> None:
    tolerance = TOLERANCE.get(run.runtime, 1e-5)
    for a, e in zip(actual, expected, strict=True):
        assert a.shape == e.shape, f"{what}: shape {tuple(a.shape)} against {tuple(e.shape)}"
        error = (a - e).abs().max().item() if a.numel() else 0.0
        assert error <= tolerance * max(1.0, e.abs().max().item()), f"{what}: differs by {error:.3g}"


def masked_by_weights(case: Case, model: nn.Module, masked: dict[str, tuple[str, str, list[int]]]) -> nn.Module:
    """A copy of `model` whose weights mask the units: `masked[group] = (module, kind, units)`; the weights each
    unit writes through (the case's own layout) are zeroed at its columns."""
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for module, kind, units in masked.values():
            for projection in case.writes(module, kind):
                weight = ref.get_parameter(projection.weight)
                for u in units:
                    weight.narrow(projection.dim, u * projection.width, projection.width).zero_()
    return ref


def masked_by_taps(twin: barter.Controller, masked: dict[str, tuple[str, str, list[int]]]) -> list:
    """Taps on `twin`'s model that zero the units' activations where they enter the output projection (and any
    heads x heads map); returns their handles."""
    def zeroing(units: list[int]):
        def fn(a: torch.Tensor) -> None:
            a[..., units, :] = 0
        return fn
    return [twin.surgeon.tap(twin.surgeon.group(name), zeroing(units)) for name, (_, _, units) in masked.items()]


def masking_references(run: Run, twin: barter.Controller, masked: dict, step: int) -> list[torch.Tensor]:
    """`twin`'s outputs on the batch of `step` with the units masked, by both references, which must agree."""
    by_weights = outputs(run, masked_by_weights(run.case, twin.model, masked), step)
    handles = masked_by_taps(twin, masked)
    try:
        by_taps = outputs(run, twin.model, step)
    finally:
        for handle in handles:
            handle.remove()
    assert_close(run, by_taps, by_weights, "the two masking references")
    return by_weights


def transferred_units(twin: barter.Controller, events: list[dict]) -> dict | None:
    """The units of `twin` (the controller before the step) that the step's executed transfers removed, or None
    when a transfer removed a unit cloned in the same step (that is no masking of the twin)."""
    origin = {g.name: list(range(g.count)) for g in twin.surgeon.groups}
    masked: dict[str, tuple[str, str, list[int]]] = {}
    for event in events:
        removed = origin[event["donor_group"]].pop(event["donor_index"])
        if removed is None:
            return None
        group = twin.surgeon.group(event["donor_group"])
        masked.setdefault(group.name, (group.module, group.kind, []))[2].append(removed)
        origin[event["receiver_group"]].append(None)
    return masked


def assert_shapes_follow(run: Run) -> None:
    """Every optimizer state tensor and the EMA copy have the parameters' shapes; every parameter is finite."""
    for name, p in run.model.named_parameters():
        assert torch.isfinite(p).all(), f"{name} is not finite"
        for key, state in run.optimizer.state[p].items():
            if torch.is_tensor(state) and state.dim():
                assert state.shape == p.shape, f"{name} {key}: {tuple(state.shape)} against {tuple(p.shape)}"
    if run.ema is not None:
        assert {n: p.shape for n, p in run.ema.module.named_parameters()} == \
            {n: p.shape for n, p in run.model.named_parameters()}


def assert_scores_nonzero(run: Run) -> None:
    """While a kind's scores are collected, every layer of it with units has non-zero D and S."""
    ctl = run.controller
    for kind, steps in ctl.schedule.items():
        if ctl.step_count < max(steps, default=0):
            for name, (d, s) in ctl.scores(kind).items():
                if d.numel():
                    assert d.abs().sum() > 0 and s.abs().sum() > 0, f"{name}: zero {kind} scores"


def train(run: Run, steps: range, checkpoint_at: int | None = None) -> bytes | None:
    """Train `steps` through the controller's transfers, checking each transfer against masking (the live model's
    outputs as the case probes them, the live model at the next forward, and the EMA copy); returns the checkpoint
    taken after `checkpoint_at` steps, if any."""
    expected, checkpoint = None, None
    for step in steps:
        if step == checkpoint_at:
            checkpoint = save(run)
        args, kwargs, target = run.case.batch(step)
        with autocast(run.runtime):
            out = run.forward(*args, **kwargs)
            loss = run.case.loss(out, target)
        assert torch.isfinite(loss), f"step {step}: loss {loss.item()}"
        if expected is not None:
            got = run.case.logits(out).detach().float()
            assert_close(run, [got], expected[:1], f"step {step}: the model after a transfer against masking")
            expected = None
        loss.backward()
        run.optimizer.step()
        run.optimizer.zero_grad()
        assert_scores_nonzero(run)
        twin = copy.deepcopy(run.controller)
        ema_before = copy.deepcopy(run.ema.module) if run.ema is not None else None
        done = len(run.controller.events)
        run.controller.step()
        masked = transferred_units(twin, [e for e in run.controller.events[done:] if e["skipped"] is None])
        if masked:
            expected = masking_references(run, twin, masked, step + 1)
            assert_close(run, outputs(run, run.model, step + 1), expected,
                         f"step {step}: the outputs as probed (a cached call) after a transfer against masking")
            if run.ema is not None:
                assert_close(run, outputs(run, run.ema.module, step + 1),
                             outputs(run, masked_by_weights(run.case, ema_before, masked), step + 1),
                             f"step {step}: the EMA copy after a transfer against masking")
        if run.ema is not None:
            run.ema.update(run.model, step=step)
        assert_shapes_follow(run)
    assert expected is None, "the last transfer was never checked"
    return checkpoint


def save(run: Run) -> bytes:
    """A training checkpoint as a file holds it."""
    buffer = io.BytesIO()
    torch.save({"model": run.model.state_dict(), "optimizer": run.optimizer.state_dict(),
                "controller": run.controller.state_dict(),
                "ema": None if run.ema is None else run.ema.state_dict()}, buffer)
    return buffer.getvalue()


def resume(case: Case, runtime: str, density: float, checkpoint: bytes) -> Run:
    """A freshly built and wrapped model, restored from `checkpoint` in the order `barter.wrap` documents."""
    run = start(case, runtime, density)
    saved = torch.load(io.BytesIO(checkpoint), weights_only=False)
    run.controller.load_state_dict(saved["controller"])
    run.model.load_state_dict(saved["model"])
    run.optimizer.load_state_dict(saved["optimizer"])
    if run.ema is not None:
        run.ema.load_state_dict(saved["ema"])
    return run


def assert_forced_edge(run: Run, rng: random.Random, export_path=None) -> None:
    """On a copy: a drawn layer brought to its edge (every removable unit removed: 0 heads, or 1 channel) equals
    masking those units by both references, and a clone in every exact group with units then keeps the outputs;
    with `export_path`, the model at its edge exports and loads equal."""
    twin = copy.deepcopy(run.controller)
    removable = sorted(g.name for g in twin.surgeon.groups if g.exact and g.count > g.min_count)
    if not removable:
        return
    group = twin.surgeon.group(rng.choice(removable))
    gone = sorted(rng.sample(range(group.count), group.count - group.min_count))
    expected = masking_references(run, twin, {group.name: (group.module, group.kind, gone)}, STEPS)
    twin.surgeon.keep(group, [u for u in range(group.count) if u not in gone])
    edged = outputs(run, twin.model, STEPS)
    assert_close(run, edged, expected, f"{group.name} at {group.count} units against masking")
    if export_path is not None:
        assert_export_loads_equal(run, twin.model, export_path)
    for g in twin.surgeon.groups:
        if g.count and g.exact:  # a clone keeps the outputs where the group is exact (barter edits no other)
            twin.surgeon.clone(g, rng.randrange(g.count), noise_std=0.1)
    assert_close(run, outputs(run, twin.model, STEPS), edged, "clones at the edge")
    for p in twin.model.parameters():
        for state in twin.optimizer.state[p].values():
            assert not (torch.is_tensor(state) and state.dim()) or state.shape == p.shape


def assert_export_loads_equal(run: Run, exported: nn.Module, path) -> None:
    """`exported` loads with equal tensors and outputs from barter's export, and a transformers model also from the
    folder `save_pretrained` writes (whose config records the call barter analysed it on)."""
    barter.export(exported, path / "export", program=False)
    folders = [path / "export"]
    if isinstance(exported, transformers.PreTrainedModel):
        exported.save_pretrained(path / "pretrained")
        folders.append(path / "pretrained")
    reference = outputs(run, copy.deepcopy(exported).eval(), STEPS)
    state = exported.state_dict()
    for folder in folders:
        loaded = barter.load(folder) if run.case.rebuilt_by_load else barter.load(folder, model=run.case.build())
        assert loaded.state_dict().keys() == state.keys(), folder.name
        for name, tensor in loaded.state_dict().items():
            assert torch.equal(tensor, state[name]), f"{name} of {folder.name}"
        assert_close(run, outputs(run, loaded.eval(), STEPS), reference, f"the loaded {folder.name}")


def check_combination(tmp_path_factory, model: str, runtime: str, width: str, lifecycle: str, seed: int) -> None:
    """Train the combination, take its lifecycle step, force a layer to its edge; `seed` draws the layer, the units
    removed and the clones' parents."""
    case, density = CASES[model], WIDTHS[width]
    run = start(case, runtime, density)
    checkpoint = train(run, range(STEPS), checkpoint_at=RESUME_AT if lifecycle == "checkpoint_resume" else None)
    if lifecycle == "checkpoint_resume":
        resumed = resume(case, runtime, density, checkpoint)
        train(resumed, range(RESUME_AT, STEPS))
        assert resumed.controller.events == run.controller.events
        for name, tensor in run.model.state_dict().items():
            assert torch.equal(resumed.model.state_dict()[name], tensor), f"{name} differs after the resume"
        if run.ema is not None:
            for name, tensor in run.ema.state_dict().items():
                assert torch.equal(resumed.ema.state_dict()[name], tensor), f"EMA {name} differs after the resume"
    exporting = lifecycle == "export_load"
    if exporting:  # the EMA copy when there is one, as a user exports it
        assert_export_loads_equal(run, run.ema.module if run.ema is not None else run.model,
                                  tmp_path_factory.mktemp("export"))
    assert_forced_edge(run, random.Random(seed), tmp_path_factory.mktemp("edge") if exporting else None)


# Together every value of every axis: each its own test, so that test workers share them.
EXAMPLES = [
    ("timm_vit", "compile", "one_unit", "checkpoint_resume", 0),
    ("hf_encoder", "ema", "one_unit", "export_load", 1),
    ("hf_decoder_cache", "amp_bf16", "half", "transfers", 2),
    ("hf_fused_gqa_cache", "compile", "one_unit", "checkpoint_resume", 5),
    ("hf_multi_query_cache", "amp_bf16", "maximum", "export_load", 6),
    ("hf_complex_rotary_cache", "ema", "half", "export_load", 7),
    ("hf_alibi_cache", "compile", "one_unit", "checkpoint_resume", 8),
    ("hf_alibi_cache", "eager", "one_unit", "transfers", 8),
    ("hf_alibi_cache", "amp_bf16", "half", "export_load", 9),
    ("hf_alibi_cache", "ema", "maximum", "export_load", 688),
    ("hf_latent_cache", "compile", "one_unit", "checkpoint_resume", 10),
    ("hf_latent_cache", "amp_bf16", "half", "export_load", 11),
    ("head_mixing", "eager", "maximum", "checkpoint_resume", 3),
    ("conv_ffn", "ema", "half", "export_load", 4),
]


@pytest.mark.parametrize("model, runtime, width, lifecycle, seed", EXAMPLES)
def test_every_axis_value_in_combination(tmp_path_factory, model, runtime, width, lifecycle, seed):
    check_combination(tmp_path_factory, model, runtime, width, lifecycle, seed)


# A few drawn combinations besides (`make soak` more).
@settings(max_examples=3 if settings.get_current_profile_name() == "ci" else 20)
@given(model=st.sampled_from(sorted(CASES)), runtime=st.sampled_from(RUNTIMES), width=st.sampled_from(sorted(WIDTHS)),
       lifecycle=st.sampled_from(LIFECYCLES), seed=st.integers(0, 2**16))
def test_features_hold_in_combination(tmp_path_factory, model, runtime, width, lifecycle, seed):
    check_combination(tmp_path_factory, model, runtime, width, lifecycle, seed)


@pytest.mark.slow
@pytest.mark.parametrize("model, runtime, width, lifecycle",
                         list(itertools.product(sorted(CASES), RUNTIMES, sorted(WIDTHS), LIFECYCLES)))
@settings(max_examples=1)
@given(seed=st.integers(0, 2**16))
def test_every_combination(tmp_path_factory, model, runtime, width, lifecycle, seed):
    check_combination(tmp_path_factory, model, runtime, width, lifecycle, seed)
