"""The method's pruning score D of every unit, measured on calibration batches: what compact initialisation by
score (`init="score"`) keeps the largest of.

D_i is the mean over the batches of d_i = mean_b |sum_j a*g| (`barter.scores.unit_scores`), with a the activations
a group's tap point hands to its output projection and g the loss gradient there: the first-order change of the
loss when unit i is removed, the score the controller picks donors by. The batches run in eval mode (no dropout,
batch norm statistics untouched) and the gradients come from `torch.autograd.grad`, so nothing of the model
changes and its parameters get no `.grad`. A tapped group that no batch reached is an error, never a zero score.
Under torch.distributed the ranks' D are averaged (one all-reduce), so every rank keeps the same units.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from .ddp import world_size
from .scores import unit_scores

Batch = tuple[Any, Any]  # (inputs, targets): inputs a tensor, a tuple of positional arguments or a dict of keywords
LossFn = Callable[[Any, Any], Tensor]  # (model outputs, targets) -> scalar loss


def calibrated_scores(surgeon, groups: Sequence, batches: Iterable[Batch],
                      loss_fn: LossFn | None = None) -> dict[str, Tensor]:
    """{group name: D of its units, shape (count,)} over `batches` (the default loss: cross-entropy)."""
    if isinstance(batches, (int, float)) or not isinstance(batches, Iterable):
        raise TypeError(f"calibration must be an iterable of (inputs, targets) batches (a DataLoader), not "
                        f"{type(batches).__name__}")
    model: nn.Module = surgeon.model
    device = next(model.parameters()).device
    loss_fn = loss_fn or nn.functional.cross_entropy
    totals = [torch.zeros(g.count, dtype=torch.float64, device=device) for g in groups]
    seen: list[tuple[int, Tensor]] = []
    handles = [surgeon.tap(g, lambda a, i=i: seen.append((i, a))) for i, g in enumerate(groups)]
    training = model.training
    model.eval()
    measured = 0
    try:
        for batch in batches:
            inputs, targets = _split(batch)
            seen.clear()
            loss = loss_fn(_call(model, _to(inputs, device)), _to(targets, device))
            _accumulate(totals, seen, loss, groups)
            measured += 1
    finally:
        for handle in handles:
            handle.remove()
        model.train(training)
    if measured == 0:
        raise ValueError("calibration gave no batches: D cannot be measured on nothing")
    flat = torch.cat(totals) / measured
    if world_size() > 1:
        torch.distributed.all_reduce(flat)
        flat /= world_size()
    return {g.name: d for g, d in zip(groups, flat.float().split([g.count for g in groups]))}


def _accumulate(totals: list[Tensor], seen: list[tuple[int, Tensor]], loss: Tensor, groups: Sequence) -> None:
    """Add this batch's d of every tapped use (a layer used at several places adds each use)."""
    used = [(i, a) for i, a in seen if a.requires_grad and a.shape[-2]]
    grads = torch.autograd.grad(loss, [a for _, a in used], allow_unused=True) if used else []
    reached = set()
    for (i, a), g in zip(used, grads):
        if g is not None:
            totals[i] += unit_scores(a.detach(), g)[0].double()
            reached.add(i)
    silent = [g.name for i, g in enumerate(groups) if g.count and i not in reached]
    if silent:
        raise RuntimeError(f"calibration measured no gradient at the tap points of {', '.join(silent)}: the forward "
                           "bypassed the graphs fxsurgery installed, or ran them without gradients (parameters "
                           "frozen, torch.no_grad), so their D would be zeros")


def _split(batch: Any) -> Batch:
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        raise TypeError(f"a calibration batch must be (inputs, targets), got {type(batch).__name__}"
                        + (f" of {len(batch)}" if isinstance(batch, (tuple, list)) else ""))
    return batch[0], batch[1]


def _call(model: nn.Module, inputs: Any) -> Any:
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def _to(value: Any, device: torch.device) -> Any:
    """`value` (a tensor, or tuples, lists and dicts of them) on `device`."""
    if isinstance(value, Tensor):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(_to(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    return value
