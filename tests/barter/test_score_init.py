"""Compact initialisation by score (init="score") and global allocation through `barter.wrap`: which units are kept,
the widths and their parameter budget, and the errors of bad values."""
import copy

import pytest
import torch
from tiny_vit import build_vit, vit_batch

import barter
from barter.calibration import calibrated_scores
from barter.compact_init import global_allocation, initial_count, unit_cost
from fxsurgery import Surgeon

HEAD_DIM = 16  # tiny_vit: width 64, 4 heads
CALIBRATION = [vit_batch(step) for step in range(3)]


def reference_scores(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """D of every head and FFN channel by plain autograd on the unwrapped timm model: the inputs of each attention
    output projection (per head) and of each fc2 (per channel), mean over the batches of mean_b |sum a*g|."""
    model = copy.deepcopy(model).eval()
    inputs: dict[str, torch.Tensor] = {}
    hooks = []
    for i, block in enumerate(model.blocks):
        for name, layer in ((f"blocks.{i}.attn:head", block.attn.proj), (f"blocks.{i}.mlp:channel", block.mlp.fc2)):
            hooks.append(layer.register_forward_pre_hook(lambda m, args, name=name: inputs.__setitem__(name, args[0])))
    totals: dict[str, torch.Tensor] = {}
    for x, y in CALIBRATION:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        grads = torch.autograd.grad(loss, list(inputs.values()))
        for (name, a), g in zip(inputs.items(), grads):
            per_unit = HEAD_DIM if name.endswith("head") else 1
            product = (a * g).reshape(a.shape[0], a.shape[1], -1, per_unit)
            d = product.sum(dim=(1, 3)).abs().mean(0)
            totals[name] = totals.get(name, 0) + d
    for hook in hooks:
        hook.remove()
    return {name: d / len(CALIBRATION) for name, d in totals.items()}


def designed_vit(seed: int) -> tuple[torch.nn.Module, dict[str, list[int]]]:
    """The tiny ViT with, in every layer, a random half of the units made to matter: their output columns (of the
    attention projection, of fc2) times 100, the others' times 0.01, so their a*g, linear in those columns, is
    10^4 times larger."""
    model = build_vit()
    generator = torch.Generator().manual_seed(seed)
    chosen = {}
    with torch.no_grad():
        for i, block in enumerate(model.blocks):
            for name, layer, count, width in ((f"blocks.{i}.attn:head", block.attn.proj, 4, HEAD_DIM),
                                              (f"blocks.{i}.mlp:channel", block.mlp.fc2, 64, 1)):
                keep = sorted(torch.randperm(count, generator=generator)[:count // 2].tolist())
                scale = torch.full((count,), 0.01)
                scale[keep] = 100.0
                layer.weight.mul_(scale.repeat_interleave(width))
                chosen[name] = keep
    return model, chosen


def test_score_keeps_exactly_the_units_made_to_matter():
    model, chosen = designed_vit(seed=0)
    ctl = barter.wrap(model, total_steps=10, density=0.5, method="static", init="score", calibration=CALIBRATION)
    assert ctl.initial_units == chosen


def test_score_keeps_the_units_of_largest_calibrated_d_and_measures_d_as_autograd_does():
    model = build_vit()
    reference = reference_scores(model)
    surgeon = Surgeon(copy.deepcopy(model), (CALIBRATION[0][0],))
    measured = calibrated_scores(surgeon, surgeon.groups, CALIBRATION)
    assert measured.keys() == reference.keys()
    for name, d in reference.items():
        torch.testing.assert_close(measured[name], d.float(), rtol=1e-4, atol=1e-9)
    ctl = barter.wrap(model, total_steps=10, density=0.3, method="static", init="score", calibration=CALIBRATION)
    for name, d in reference.items():
        keep = initial_count(len(d), 0.3)
        assert ctl.initial_units[name] == sorted(d.topk(keep).indices.tolist()), name
    assert all(p.grad is None for p in model.parameters()) and model.training  # calibration leaves no trace


def test_calibration_that_reaches_no_tap_is_an_error_not_a_zero_score():
    model = build_vit()
    for p in model.parameters():
        p.requires_grad_(False)
    with pytest.raises(RuntimeError, match="no gradient at the tap points"):
        barter.wrap(model, total_steps=10, init="score", calibration=CALIBRATION)


def test_global_allocation_on_hand_made_numbers():
    importances = [torch.tensor([5.0, 1.0, 3.0]), torch.tensor([0.5, 0.2]), torch.tensor([9.0, 8.0, 0.1, 7.0])]
    costs = [2, 1, 10]
    # per parameter: layer 0 -> 2.5, 0.5, 1.5; layer 1 -> 0.5, 0.2; layer 2 -> 0.9, 0.8, 0.01, 0.7
    # minimum first: units 0, 0, 0 (cost 13); then layer 0's unit 2 (15), layer 2's unit 1 (25): layer 0's unit 1
    # and layer 1's unit 0 (27) fit, layer 2's unit 3 (10) does not, layer 1's unit 1 (28) does
    assert global_allocation(importances, costs, budget=28) == [[0, 1, 2], [0, 1], [0, 1]]
    assert global_allocation(importances, costs, budget=13) == [[0], [0], [0]]
    with pytest.raises(ValueError, match="cannot keep one unit per layer"):
        global_allocation(importances, costs, budget=12)


@pytest.mark.parametrize("init", ["magnitude", "score"])
def test_global_allocation_keeps_the_budget_and_a_unit_per_layer(init):
    calibration = {"calibration": CALIBRATION} if init == "score" else {}
    uniform = barter.wrap(build_vit(), total_steps=10, density=0.3, method="static")
    model = build_vit()
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    importance = {g.name: g for g in Surgeon(copy.deepcopy(model), (CALIBRATION[0][0],)).groups}
    ctl = barter.wrap(model, total_steps=10, density=0.3, method="static", init=init, allocation="global",
                      **calibration)
    groups = ctl.surgeon.groups
    costs = {g.name: unit_cost(importance[g.name], shapes) for g in groups}
    assert costs["blocks.0.attn:head"] == 4 * HEAD_DIM * 64 + 3 * HEAD_DIM  # qkv rows + bias, projection columns
    assert costs["blocks.0.mlp:channel"] == 64 + 1 + 64
    budget = sum(costs[g.name] * initial_count(g.max_count, 0.3) for g in groups)
    spent = sum(costs[g.name] * g.count for g in groups)
    assert all(g.count >= 1 for g in groups)
    assert budget - min(costs.values()) < spent <= budget
    size = sum(p.numel() for p in model.parameters())
    assert size - sum(p.numel() for p in uniform.model.parameters()) == spent - budget
    assert [g.count for g in groups] != [g.count for g in uniform.surgeon.groups]  # the widths did move


@pytest.mark.parametrize("kwargs,error,match", [
    ({"init": "score"}, ValueError, "calibration=<loader>"),
    ({"init": "first", "calibration": CALIBRATION}, ValueError, "init='score' only"),
    ({"init": "score", "calibration": 3}, TypeError, "iterable of"),
    ({"init": "score", "calibration": []}, ValueError, "no batches"),
    ({"init": "score", "calibration": [CALIBRATION[0][0]]}, TypeError, r"\(inputs, targets\)"),
    ({"loss_fn": torch.nn.functional.mse_loss}, ValueError, "needs calibration"),
    ({"allocation": "global"}, ValueError, "needs init in"),
    ({"allocation": "everywhere", "init": "magnitude"}, ValueError, "allocation must be one of"),
    ({"init": "largest"}, ValueError, "init must be one of"),
])
def test_bad_values_are_clear_errors(kwargs, error, match):
    model = build_vit()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(error, match=match):
        barter.wrap(model, total_steps=10, **kwargs)
    after = model.state_dict()
    assert all(after[k].shape == v.shape for k, v in before.items())  # nothing was cut
