"""Tensor edits along a unit axis laid out as ``[outer][unit][inner]``, and the optimizer state that
must follow them. Every edit is vectorised and touches only the group's own tensors."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import OptimizerStateError


@dataclass(frozen=True)
class ParamSlice:
    """A parameter or buffer of a group: unit i owns positions ``o·count·inner + i·inner + r`` along
    ``dim`` (o < outer, r < inner). ``output`` marks the output projection's columns."""

    name: str
    dim: int
    outer: int
    inner: int
    output: bool

    def units(self, t: torch.Tensor, count: int) -> torch.Tensor:
        """View of ``t`` with the unit index as its own axis at ``dim + 1``."""
        s = t.shape
        return t.reshape(s[: self.dim] + (self.outer, count, self.inner) + s[self.dim + 1:])

    def flat(self, v: torch.Tensor) -> torch.Tensor:
        s = v.shape
        return v.reshape(s[: self.dim] + (s[self.dim] * s[self.dim + 1] * s[self.dim + 2],) + s[self.dim + 3:])

    def keep(self, t: torch.Tensor, count: int, index: torch.Tensor) -> torch.Tensor:
        """Only the units in ``index``, in that order (no zero slots). An index of a few runs of consecutive units
        (a removal keeps two) is copied run by run: a gather of single columns is many times slower."""
        v = self.units(t, count)
        runs = _runs(index)
        if runs is None:
            return self.flat(v.index_select(self.dim + 1, index.to(t.device)))
        return self.flat(torch.cat([v.narrow(self.dim + 1, start, size) for start, size in runs], self.dim + 1))

    def append(self, t: torch.Tensor, count: int, new: torch.Tensor) -> torch.Tensor:
        """``t`` with one more unit whose slice is ``new`` (shaped like one unit's slice)."""
        return self.flat(torch.cat([self.units(t, count), new.unsqueeze(self.dim + 1)], self.dim + 1))

    def unit(self, t: torch.Tensor, count: int, i: int) -> torch.Tensor:
        return self.units(t, count).select(self.dim + 1, i)


MAX_RUNS = 8  # more runs of consecutive units than this: one gather


def _runs(index: torch.Tensor) -> list[tuple[int, int]] | None:
    """(start, size) of each run of consecutive units in a host-side ``index``, if it has at most ``MAX_RUNS``."""
    if index.device.type != "cpu" or not index.numel():
        return None
    runs: list[tuple[int, int]] = []
    for k in index.tolist():
        if runs and runs[-1][0] + runs[-1][1] == k:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        elif len(runs) == MAX_RUNS:
            return None
        else:
            runs.append((k, 1))
    return runs


def state_tensors(optimizers: list[torch.optim.Optimizer], p: torch.Tensor) -> list[tuple[dict, str]]:
    """(state dict, key) of every per-element state tensor of ``p``; refuses state it cannot map."""
    out = []
    for opt in optimizers:
        st = opt.state.get(p)
        if not st:
            continue
        for k, v in st.items():
            if not torch.is_tensor(v) or v.dim() == 0:
                continue  # step counters and scalars stay as they are
            if v.shape != p.shape:
                raise OptimizerStateError(
                    f"{type(opt).__name__} state '{k}' has shape {tuple(v.shape)} for a parameter of shape "
                    f"{tuple(p.shape)}; only state shaped like its parameter (Adam, AdamW, SGD momentum, ...) "
                    "can be resized")
            out.append((st, k))
    return out


def clone_unit(t: torch.Tensor, sl: ParamSlice, count: int, parent: int, noise: torch.Tensor | None) -> torch.Tensor:
    """Copy the parent's slice as a new last unit; on output slices split it W/2 + ε and W/2 − ε."""
    v = sl.units(t, count)
    w = v.select(sl.dim + 1, parent)
    if not sl.output:
        return sl.append(t, count, w)
    half = w / 2
    eps = noise if noise is not None else torch.zeros_like(half)
    out = sl.append(t, count, half - eps)  # a new tensor: the parent's half is written into it
    sl.unit(out, count + 1, parent).copy_(half + eps)
    return out


def clone_state(t: torch.Tensor, sl: ParamSlice, count: int, parent: int) -> torch.Tensor:
    """Optimizer state after a clone: the parent and the new unit start from zero."""
    out = sl.append(t, count, torch.zeros_like(sl.unit(t, count, parent)))  # a new tensor: the parent is zeroed in it
    sl.unit(out, count + 1, parent).zero_()
    return out
