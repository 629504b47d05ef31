"""The public entry point: find unit groups in a model and remove or clone units in place."""
from __future__ import annotations

import copy
import dataclasses
import itertools
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn

from .analysis.install import install_model, installs_on
from .analysis.value import Analysis, analyse, run_once, structure, structure_difference
from .capture.calls import materialize
from .clone_state import StateAtClone
from .compat import tree_leaves, tree_map
from .dataflow.input_gathers import index_values
from .dataflow.paths import join_path
from .editing import Editor, TensorAccess
from .groups import LeftOut, UnitGroup
from .report import explain
from .runtime.graph_forward import GraphForward
from .slicing import by_tensor, check_optimizer_layout, state_tensors, unit_squares


class Surgeon:
    """Install an analysis of ``model`` (``fxsurgery.analyse``) and operate on its unit groups in place:
    ``Surgeon(model, analysis)``, or ``Surgeon(model, example_inputs, example_kwargs)`` to analyse and install
    in one step.

    The model keeps its class, methods, parameter objects and ``state_dict`` keys; the modules that
    host units get a rewritten forward. Every group passed a self-check at analysis: a clone must leave the
    host's outputs unchanged and a removal must equal masking the unit."""

    def __init__(self, model: nn.Module, example_inputs: Analysis | Any = (),
                 example_kwargs: dict[str, Any] | None = None):
        if isinstance(example_inputs, Analysis):
            if example_kwargs:
                raise ValueError("pass an Analysis or an example call, not both: the analysis holds its call")
            analysis = example_inputs
            now = structure(model)
            if now != analysis.structure:
                raise ValueError(f"the analysis is of another model than this {type(model).__name__}: "
                                 f"{structure_difference(analysis.structure, now)}")
            analysis = _called_where_it_lives(model, analysis)
            run_once(model, analysis.example_inputs, analysis.example_kwargs)  # its first-call state, as analysed
            if analysis._plan is None or not installs_on(model, analysis._plan):
                analysis = _analysed_again(model, analysis)  # unpickled or copied, or its hosts have changed since
        else:  # analysed here and now: of this model, whose hosts' fingerprints are its copy's
            analysis = analyse(model, example_inputs, example_kwargs)
            analysis._plan.shared.hand_keys_to(model)
            run_once(model, analysis.example_inputs, analysis.example_kwargs)  # its first-call state, as analysed
        self.model = model
        self.analysis = analysis.without_plan()
        self.example_inputs = analysis.example_inputs
        self.example_kwargs = analysis.example_kwargs
        self._editor = Editor(model)
        # the analysis's descriptions, each with a live state of its own that only this Surgeon's edits change
        self.groups: list[UnitGroup] = [UnitGroup(description) for description in analysis.groups]
        install_model(model, analysis._plan, self.groups, self._editor)
        self.left_out: list[LeftOut] = list(analysis.left_out)
        self._front_ends = dict(analysis.front_ends)

    def group(self, name: str) -> UnitGroup:
        for g in self.groups:
            if g.name == name:
                return g
        raise KeyError(f"no group named {name!r}; groups: {[g.name for g in self.groups]}")

    def of_copy(self, model: nn.Module) -> "Surgeon":
        """The surgeon of ``model``, a deep copy of this surgeon's model made after the install (an averaged copy of
        it): the same groups at their counts, no optimizer attached. The copy is not analysed again: at compact
        widths an analysis may find fewer groups (a 1 x 1 heads x heads map does not tell which axis is the head's).
        ValueError when ``model`` is not such a copy."""
        hosts = {plumbing.host for plumbing in self._editor.plumbing.values()}
        shapes = {name: tuple(t.shape) for name, t in self.model.state_dict(keep_vars=True).items()}
        if {name: tuple(t.shape) for name, t in model.state_dict(keep_vars=True).items()} != shapes:
            raise ValueError(f"{type(model).__name__} has other tensors or shapes than the installed model")
        uninstalled = sorted(h for h in hosts if (GraphForward.of(self.model.get_submodule(h)) is None)
                             != (GraphForward.of(model.get_submodule(h)) is None))
        if uninstalled:
            raise ValueError(f"{type(model).__name__} is no copy of the installed model: its hosts {uninstalled} "
                             "run another forward")
        memo: dict[int, Any] = {id(self._editor.optimizers): []}
        pairs = [(self.model.named_modules(), model.named_modules()),
                 (self.model.named_parameters(), model.named_parameters()),
                 (self.model.named_buffers(), model.named_buffers())]
        for live, copied in pairs:
            memo.update((id(a), b) for (_, a), (_, b) in zip(live, copied))
        surgeon = copy.deepcopy(self, memo)
        surgeon._editor.access = TensorAccess()
        return surgeon

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Keep ``optimizer``'s per-parameter state in step with every remove and clone."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
        check_optimizer_layout(optimizer)  # once: an optimizer's class, so its state's layout, never changes
        for g in self.groups:
            for sl in g.slices:
                state_tensors([optimizer], self._editor.tensor(sl.name))
        if all(o is not optimizer for o in self._editor.optimizers):
            self._editor.optimizers.append(optimizer)

    def set_tensor_access(self, access: TensorAccess) -> None:
        """Read and write the groups' tensors and optimizer state through ``access`` from now on (tensors whose
        values are laid out elsewhere, such as sharded over processes; ``TensorAccess()`` for plain ones)."""
        self._editor.access = access

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
              generator: torch.Generator | None = None, relative: bool = False,
              state: StateAtClone = StateAtClone.ZERO) -> int:
        """Append a copy of unit ``parent``; its output weights are split W/2 + ε and W/2 − ε with
        ε ~ N(0, σ²), σ = ``noise_std`` (times the std of the parent's output weights if ``relative``).
        ``state``: the attached optimizers' state of the parent and the copy, zeroed, split with the weights or
        restarted (``fxsurgery.clone_state``). Returns the new unit's index."""
        g = self._own(group)
        if not 0 <= parent < g.count:
            raise IndexError(f"{g.name}: parent {parent} out of range for {g.count} units")
        new = g.count
        self._editor.clone(g, parent, noise_std, generator, relative, StateAtClone(state))
        return new

    @torch.no_grad()
    def scale_output(self, group: UnitGroup, index: int, factor: float) -> None:
        """Multiply unit ``index``'s output slices (where it enters the others) by ``factor`` in place: 0 masks it
        as a removal would, a factor between fades it. Optimizer state and sizes are left as they are."""
        g = self._own(group)
        if not 0 <= index < g.count:
            raise IndexError(f"{g.name}: unit {index} out of range for {g.count} units")
        access = self._editor.access
        for name, slices in by_tensor(g.slices):
            outputs = [sl for sl in slices if sl.output]
            if not outputs:
                continue
            t = self._editor.tensor(name)
            values = access.values(t)
            for sl in outputs:
                sl.unit(values, g.count, index).mul_(factor)
            if values.data_ptr() != t.data_ptr():  # gathered (a sharded tensor): lay the values out again
                access.write(t, values)

    def unit_norms(self, group: UnitGroup) -> torch.Tensor:
        """L2 norm of each unit's parameters (all its slices together, each element once), shape ``(count,)``."""
        g = self._own(group)
        total = None
        for name, slices in by_tensor(g.slices):
            sq = unit_squares(self._editor.access.values(self._editor.tensor(name)).detach(), slices, g.count)
            total = sq if total is None else total + sq.to(total.device)
        return total.sqrt()

    def tap(self, group: UnitGroup, fn: Callable[[torch.Tensor], None], *,
            grad_only: bool = False) -> torch.utils.hooks.RemovableHandle:
        """Call ``fn(a)`` in every forward with the activations that feed the group's output
        projection, viewed as ``(*lead, count, per_unit)``, and, for heads mixed by heads×heads maps, with
        each map's input viewed alike (a head enters the others there too): zeroing a unit in every call masks
        it as a removal would. Changes ``fn`` makes to ``a`` reach the forward. Every front end's graph calls
        the tap. ``grad_only``: ``fn`` measures gradients (it hooks ``a``'s), so it is called only where ``a``
        requires grad, and a call without gradients (generation under ``no_grad``) may be served where it could
        not be tapped. ``handle.remove()`` stops it."""
        g = self._own(group)
        return self._editor.tap_point(g).add(fn, grad_only=grad_only)

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

    def installed_state(self) -> dict[str, torch.Tensor]:
        """The buffers the install added to the model (the index buffers by which a layer reads its units' entries of
        a module input, as ALiBi slopes), by state_dict name, each on the CPU at its width as analysed: a model
        materialised from the meta device (``to_empty``) must be given them again, each at the units it keeps."""
        found = {}
        for host in self._front_ends:
            installed = GraphForward.of(self.model.get_submodule(host))
            for graph in ([] if installed is None else installed.graphs.values()):
                if graph is not None:
                    found.update({join_path(host, name): values for name, values in index_values(graph).items()})
        return found

    def _own(self, group: UnitGroup) -> UnitGroup:
        if not any(group is g for g in self.groups):
            raise ValueError(f"{getattr(group, 'name', group)!r} is not a group of this Surgeon")
        return group


def _analysed_again(model: nn.Module, analysis: Analysis) -> Analysis:
    """``model`` analysed again as ``analysis`` was (one without its plan, or whose hosts have changed since); it
    must find the same."""
    fresh = analyse(model, analysis.example_inputs, analysis.example_kwargs)
    if fresh != analysis:
        raise ValueError(f"analysing this {type(model).__name__} again finds other groups than the analysis given: "
                         f"{[g.name for g in fresh.groups]} against {[g.name for g in analysis.groups]}")
    fresh._plan.shared.hand_keys_to(model)
    return fresh


def _called_where_it_lives(model: nn.Module, analysis: Analysis) -> Analysis:
    """The analysis with its example call on the model's device: an analysis of the model built on the meta device
    (``barter.wrap`` before materialising) given a real model holds meta inputs, which stand in as real values of
    their shapes (the call's values matter to neither the install nor the first call, only its shapes)."""
    device = next((t.device for t in itertools.chain(model.parameters(), model.buffers()) if not t.is_meta), None)
    call = (analysis.example_inputs, analysis.example_kwargs)
    if device is None or not any(torch.is_tensor(t) and t.is_meta for t in tree_leaves(call)):
        return analysis
    inputs, kwargs = tree_map(lambda t: t.to(device) if torch.is_tensor(t) else t, materialize(call))
    return dataclasses.replace(analysis, example_inputs=inputs, example_kwargs=kwargs)
