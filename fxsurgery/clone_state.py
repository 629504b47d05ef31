"""Optimizer state of a cloned unit: what the parent and its copy start from (``StateAtClone``), and the per-step
correction that gives restarted slices their own Adam bias correction.

``ZERO``: both start from zero moments; the optimizer's step counter (one per parameter tensor) is kept, so Adam's
bias correction 1 − β^t is already ≈ 1 and their first updates after k steps are about (1 − β1^k)/√(1 − β2^k)
times a kept unit's (3.2× at k = 1 for β = (0.9, 0.999)).

``SPLIT``: both carry the parent's state, scaled as the clone scales the weights. The clone copies input-side
slices and halves output slices (W/2 ± ε); a state of degree d in the weights (a first moment or momentum: d = 1,
a second moment: d = 2, ``STATE_DEGREE``) is copied on input-side slices and scaled by (1/2)^d on output slices,
so m → m/2, v → v/4: Adam's normalised update m̂/√v̂ is invariant to that, so each half starts at the parent's pace
in the parent's direction (ε is ignored; the step counter is kept). What comes after is not the parent's: each
half's output gradient is the parent's whole gradient (the twins' features are identical), four times as heavy
against v/4 as it was against v.

``RESTART``: both start from zero moments, as ``ZERO``, and Adam's bias correction restarts for their elements
alone. torch's Adam keeps one step counter per parameter tensor, so the clone stamps the step t0 it happened
after into a state tensor shaped like the parameter (``RESTART_KEY``; resized, saved and loaded with the rest of
the state) and ``correct_restarted``, run after every optimizer step t, replaces the update torch applied with the
one of a fresh start k = t − t0 steps old, element by element:

    p += lr·m̂_t/(√v̂_t + eps) − lr·m̂_k/(√v̂_k + eps),  m̂_j = m/(1 − β1^j), v̂_j = v/(1 − β2^j)

(v: the running maximum with amsgrad). The moments themselves are a fresh start's already (zero at the clone, the
same gradients since), and weight decay, L2 or decoupled, is the same in both updates, so the result is exactly
Adam run from the clone with a step counter of its own. Adam and AdamW (and their subclasses) only.
"""
from __future__ import annotations

from enum import Enum

import torch

from .errors import OptimizerStateError
from .slicing import ParamSlice

RESTART_KEY = "fxsurgery_restarted_at"  # per-element optimizer step after which the element's moments restarted


class StateAtClone(str, Enum):
    """What the optimizer state of a cloned unit (the parent and its copy) starts from."""

    ZERO = "zero"
    SPLIT = "split"
    RESTART = "restart"


# degree in the weights of each per-element state of torch.optim's optimizers: how SPLIT scales it
STATE_DEGREE = {"exp_avg": 1, "momentum_buffer": 1, "exp_avg_sq": 2, "max_exp_avg_sq": 2, "square_avg": 2,
                "grad_avg": 1, "sum": 2, "acc_delta": 2, "exp_inf": 1, "ax": 1, "prev": 1, "step_size": 1,
                "mu_product": 0}


def state_at_clone(t: torch.Tensor, sl: ParamSlice, count: int, parent: int, *, how: StateAtClone, key: str,
                   step: float) -> torch.Tensor:
    """Optimizer state ``key`` of one slice after unit ``parent`` is cloned as unit ``count``, as ``how`` says;
    ``step``: the optimizer step the clone follows (stamped under ``RESTART_KEY``)."""
    if key == RESTART_KEY:
        value = step if how is StateAtClone.RESTART else 0.0  # ZERO and SPLIT: no own bias correction
        out = sl.append(t, count, torch.full_like(sl.unit(t, count, parent), value))
        sl.unit(out, count + 1, parent).fill_(value)
        return out
    if how is StateAtClone.SPLIT:
        if key not in STATE_DEGREE:
            raise OptimizerStateError(f"state '{key}' has no known degree in the weights, so it cannot be split "
                                      f"with them (known: {sorted(STATE_DEGREE)})")
        w = sl.unit(t, count, parent)
        scale = 0.5 ** STATE_DEGREE[key] if sl.output else 1.0
        out = sl.append(t, count, w * scale)
        sl.unit(out, count + 1, parent).mul_(scale)
        return out
    out = sl.append(t, count, torch.zeros_like(sl.unit(t, count, parent)))  # a new tensor: the parent is zeroed in it
    sl.unit(out, count + 1, parent).zero_()
    return out


def stamp_restarts(optimizers: list[torch.optim.Optimizer], params: list[torch.Tensor]) -> None:
    """Before a RESTART clone: refuse optimizers without Adam's bias correction, and give each parameter with Adam
    state a ``RESTART_KEY`` tensor (zeros: no element restarted) for the clone to stamp."""
    for opt in optimizers:
        held = [p for p in params if opt.state.get(p)]
        if held and not isinstance(opt, torch.optim.Adam):
            raise OptimizerStateError(f"state at clone 'restart' restarts Adam's bias correction; "
                                      f"{type(opt).__name__} has none (use Adam or AdamW, or 'zero')")
        for p in held:
            st = opt.state[p]
            if RESTART_KEY not in st:
                if p.dtype not in (torch.float32, torch.float64):
                    raise OptimizerStateError(f"state at clone 'restart' stamps step counts in the parameter's "
                                              f"dtype, which {p.dtype} cannot hold exactly (float32 or float64)")
                st[RESTART_KEY] = torch.zeros_like(p, memory_format=torch.preserve_format)


def clone_step(optimizers: list[torch.optim.Optimizer], p: torch.Tensor) -> float:
    """The optimizer step of ``p`` a clone now follows (0 before any step)."""
    for opt in optimizers:
        step = opt.state.get(p, {}).get("step")
        if step is not None:
            return float(step)
    return 0.0


@torch.no_grad()
def correct_restarted(optimizer: torch.optim.Optimizer) -> None:
    """Right after ``optimizer.step()``: give the elements a RESTART clone stamped the update of their own bias
    correction instead of the parameter's (module docstring)."""
    for group in optimizer.param_groups:
        beta1, beta2 = group["betas"]
        lr, eps = group["lr"], group["eps"]
        for p in group["params"]:
            st = optimizer.state.get(p)
            if not st or RESTART_KEY not in st:
                continue
            stamp = st[RESTART_KEY]
            restarted = stamp > 0  # no host sync to skip an unstamped tensor: its correction adds exact zeros
            t = float(st["step"])
            m = st["exp_avg"]
            v = st["max_exp_avg_sq"] if group.get("amsgrad") else st["exp_avg_sq"]
            age = torch.where(restarted, t - stamp, torch.full_like(stamp, t)).clamp_min(1)
            applied = lr / (1 - beta1 ** t) * m / (v.sqrt() / (1 - beta2 ** t) ** 0.5 + eps)
            own = lr / (1 - beta1 ** age) * m / (v.sqrt() / (1 - beta2 ** age).sqrt() + eps)
            p.add_(torch.where(restarted, applied - own, torch.zeros_like(p)))
