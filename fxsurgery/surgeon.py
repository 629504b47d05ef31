"""The public entry point: find unit groups in a model and remove or clone units in place."""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.nn as nn

from .analysis.model import analyse_model
from .capture.graph_forward import GraphForward
from .editing import Editor
from .groups import LeftOut, UnitGroup
from .report import explain
from .slicing import state_tensors


class Surgeon:
    """Trace ``model`` called as ``model(*example_inputs, **example_kwargs)``, find its unit groups, and
    operate on them in place.

    The model keeps its class, methods, parameter objects and ``state_dict`` keys; the modules that
    host units get a rewritten forward. Every group is checked once on the live model at analysis:
    a clone must leave the host's outputs unchanged and a removal must equal masking the unit."""

    def __init__(self, model: nn.Module, example_inputs: Any = (), example_kwargs: dict[str, Any] | None = None):
        if not example_inputs and not example_kwargs:
            raise ValueError("Surgeon needs an example call of the model: example_inputs and/or example_kwargs")
        self.model = model
        self.example_inputs = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
        self.example_kwargs = dict(example_kwargs or {})
        self._editor = Editor(model)
        found = analyse_model(model, (self.example_inputs, self.example_kwargs), self._editor)
        self.groups: list[UnitGroup] = found.groups
        self.left_out: list[LeftOut] = found.left_out
        self._front_ends = found.front_ends

    def group(self, name: str) -> UnitGroup:
        for g in self.groups:
            if g.name == name:
                return g
        raise KeyError(f"no group named {name!r}; groups: {[g.name for g in self.groups]}")

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Keep ``optimizer``'s per-parameter state in step with every remove and clone."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
        for g in self.groups:
            for sl in g.slices:
                state_tensors([optimizer], self._editor.tensor(sl.name))
        if all(o is not optimizer for o in self._editor.optimizers):
            self._editor.optimizers.append(optimizer)

    def remove(self, group: UnitGroup, index: int) -> None:
        """Delete unit ``index``; the remaining units keep their relative order."""
        g = self._own(group)
        if not 0 <= index < g.count:
            raise IndexError(f"{g.name}: unit {index} out of range for {g.count} units")
        self._editor.keep(g, torch.tensor([k for k in range(g.count) if k != index], dtype=torch.long))

    def keep(self, group: UnitGroup, indices: Sequence[int]) -> None:
        """Keep only the units ``indices``, in that order, in one edit (a batched ``remove``)."""
        g = self._own(group)
        idx = torch.as_tensor(list(indices), dtype=torch.long)
        if idx.numel() and (idx.min() < 0 or idx.max() >= g.count):
            raise IndexError(f"{g.name}: units {idx.tolist()} out of range for {g.count} units")
        if torch.unique(idx).numel() != idx.numel():
            raise ValueError(f"{g.name}: repeated units in {idx.tolist()}")
        self._editor.keep(g, idx)

    def clone(self, group: UnitGroup, parent: int, noise_std: float = 0.0,
              generator: torch.Generator | None = None, relative: bool = False) -> int:
        """Append a copy of unit ``parent``; its output weights are split W/2 + ε and W/2 − ε with
        ε ~ N(0, σ²), σ = ``noise_std`` (times the std of the parent's output weights if ``relative``).
        Returns the new unit's index."""
        g = self._own(group)
        if not 0 <= parent < g.count:
            raise IndexError(f"{g.name}: parent {parent} out of range for {g.count} units")
        new = g.count
        self._editor.clone(g, parent, self._editor.noise(g, parent, noise_std, generator, relative))
        return new

    def unit_norms(self, group: UnitGroup) -> torch.Tensor:
        """L2 norm of each unit's parameters (all its slices together), shape ``(count,)``."""
        g = self._own(group)
        total = None
        for sl in g.slices:
            v = sl.units(self._editor.tensor(sl.name).detach(), g.count).float()
            sq = v.square().sum(dim=[d for d in range(v.dim()) if d != sl.dim + 1])
            total = sq if total is None else total + sq.to(total.device)
        return total.sqrt()

    def tap(self, group: UnitGroup, fn: Callable[[torch.Tensor], None]) -> torch.utils.hooks.RemovableHandle:
        """Call ``fn(a)`` in every forward with the activations that feed the group's output
        projection, viewed as ``(*lead, count, per_unit)``; changes ``fn`` makes to ``a`` reach the
        projection. Every front end's graph calls the tap. ``handle.remove()`` stops it."""
        g = self._own(group)
        return self._editor.tap_point(g).add(fn)

    def explain(self) -> str:
        """A table of the groups (count / max, exactness, sliced tensors, rewritten constants) and of
        what was left out and why, which front end recorded each host module, and how many graphs each host
        holds for the calls it has served (or which calls its own forward served, and why)."""
        served = {}
        for host in self._front_ends:
            installed = GraphForward.of(self.model.get_submodule(host))
            served[host] = list(installed.served.values()) if installed is not None else []
        return explain(type(self.model).__name__, self.groups, self.left_out, self._editor.plumbing,
                       front_ends=self._front_ends, served=served)

    def _own(self, group: UnitGroup) -> UnitGroup:
        if not any(group is g for g in self.groups):
            raise ValueError(f"{getattr(group, 'name', group)!r} is not a group of this Surgeon")
        return group
