"""The edit transaction: a group's parameters, optimizer state, host constants and module sizes change
together, and a failure leaves the model untouched."""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

from .clone_state import StateAtClone, clone_step, stamp_restarts, state_at_clone
from .dataflow.constants import ConstantSpec, set_path
from .dataflow.paths import tensor_at
from .groups import ConstantSlot, GroupPlumbing, UnitGroup
from .module_sizes import sync_sizes
from .slicing import ParamSlice, by_tensor, clone_unit, in_turn, moved_by, state_tensors
from .taps import TapPoint
from .unit_kind import UnitKind

TensorEdit = Callable[[ParamSlice, torch.Tensor], torch.Tensor]
StateEdit = Callable[[torch.Tensor, str], TensorEdit]  # (parameter, state key) -> the edit of that state tensor
CONSTANT_PREFIX = "_fxsurgery_constant"  # the host attributes that hold count-dependent graph constants (slots)


class TensorAccess:
    """How an edit reads and writes a group's tensors: here, each tensor holds all its values. A subclass serves
    tensors whose values are laid out elsewhere (sharded over processes): it gathers them whole for the edit and
    lays the edited values out again, keeping the tensor objects."""

    def values(self, t: torch.Tensor) -> torch.Tensor:
        """All of ``t``'s values (a parameter, buffer or optimizer state tensor) as one plain tensor."""
        return t.data

    def write(self, t: torch.Tensor, values: torch.Tensor) -> None:
        """Make the parameter or buffer ``t`` hold ``values``, resized, as the same object."""
        replace_data(t, values)

    def state(self, old: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """The optimizer state tensor that holds ``values``, laid out as ``old`` was."""
        return values


class Editor:
    """Operates on the groups of one model; keeps each group's plumbing, the attached optimizers and the
    access to their tensors."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.optimizers: list[torch.optim.Optimizer] = []
        self.plumbing: dict[UnitGroup, GroupPlumbing] = {}
        self.access = TensorAccess()

    def tensor(self, name: str) -> torch.Tensor:
        return tensor_at(self.model, name)

    def submodule(self, name: str) -> nn.Module | None:
        """The module ``name`` ("" for the model), or None if there is none of that name."""
        try:
            return self.model.get_submodule(name)
        except AttributeError:
            return None

    def host(self, g: UnitGroup) -> nn.Module:
        host = self.plumbing[g].host
        return self.model.get_submodule(host) if host else self.model

    def tap_point(self, g: UnitGroup) -> TapPoint:
        """The point where the group's host graphs hand its units to the output projection."""
        return self.host(g).__dict__[self.plumbing[g].tap_point]

    def keep(self, g: UnitGroup, idx: torch.Tensor) -> None:
        """Only the units ``idx``, in that order: parameters and optimizer state alike."""
        if idx.numel() < g.min_count:
            why = "; ".join(g.notes) if g.kind == UnitKind.HEAD else "a layer keeps at least one channel"
            raise ValueError(f"{g.name}: cannot go below {g.min_count} unit(s) ({why})")
        count = g.count
        self.edit(g, idx.numel(), lambda sl, t: sl.keep(t, count, idx),
                  lambda p, key: lambda sl, t: sl.keep(t, count, idx))

    def clone(self, g: UnitGroup, parent: int, std: float, generator: torch.Generator | None,
              relative: bool, state: StateAtClone = StateAtClone.ZERO) -> None:
        """Append a copy of unit ``parent``; split noise (``noise``) on its output weights, which the edit then
        reads as the noise did (each tensor's values are read once); its optimizer state as ``state`` says."""
        count, read = g.count, {}
        noise = self.noise(g, parent, std, generator, relative, read)
        if state is StateAtClone.RESTART:
            stamp_restarts(self.optimizers, [self.tensor(name) for name, _ in by_tensor(g.slices)])

        def state_edit(p: torch.Tensor, key: str) -> TensorEdit:
            step = clone_step(self.optimizers, p)
            return lambda sl, t: state_at_clone(t, sl, count, parent, how=state, key=key, step=step)

        self.edit(g, count + 1, lambda sl, t: clone_unit(t, sl, count, parent, noise.get(sl.name)), state_edit,
                  read=read)

    def noise(self, g: UnitGroup, parent: int, std: float, generator: torch.Generator | None,
              relative: bool, read: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """ε ~ N(0, σ²) for each output slice of unit ``parent`` (σ relative to its weights' std if asked); the
        values of each tensor read are left in ``read`` by name."""
        out = {}
        if std == 0:
            return out
        read = {} if read is None else read
        for sl in g.slices:
            if not sl.output:
                continue
            if sl.name not in read:
                read[sl.name] = self.access.values(self.tensor(sl.name))
            w = sl.unit(read[sl.name], g.count, parent)
            sigma = std * (float(w.float().std()) if relative and w.numel() > 1 else 1.0)
            dev = generator.device if generator is not None else w.device
            out[sl.name] = (torch.randn(w.shape, generator=generator, device=dev, dtype=torch.float32) * sigma).to(w)
        return out

    def edit(self, g: UnitGroup, new_count: int, data_fn: TensorEdit, state_fn: StateEdit | None, *,
             read: dict[str, torch.Tensor] | None = None) -> None:
        """Compute every new tensor first, then swap them in: a failure leaves the model untouched. A tensor
        sliced along two dims (a head-mixing map) takes its edits in turn (``slicing.in_turn``). ``state_fn(p, key)``:
        the edit of ``p``'s optimizer state ``key``; without it optimizer state is left alone (the self-check's trial
        edits). ``read``: values read already, by tensor name, each dropped once used (a sharded tensor is gathered
        once)."""
        tensors = [(name, slices, self.tensor(name)) for name, slices in by_tensor(g.slices)]
        optimizers = self.optimizers if state_fn is not None else []
        states = [(slices, st, k, t) for _, slices, t in tensors for st, k in state_tensors(optimizers, t)]
        access, read = self.access, {} if read is None else read
        new_data = [(t, in_turn(data_fn, slices, read.pop(name) if name in read else access.values(t)))
                    for name, slices, t in tensors]
        new_state = [(st, k, in_turn(state_fn(t, k), slices, access.values(st[k]))) for slices, st, k, t in states]
        for t, d in new_data:
            access.write(t, d)
        for st, k, v in new_state:
            st[k] = access.state(st[k], v)
        self.settle(g, new_count)

    def settle(self, g: UnitGroup, count: int) -> None:
        """Set the count, and the host constants, module sizes and segments of other groups that follow it (a
        group whose segment of a fused projection lies after this group's moves with it)."""
        moves = [(sl, (count - g.count) * sl.outer * sl.inner) for sl in g.slices]
        for other in self.plumbing:  # the group's own later pieces of a dim move too
            other._state.slices = tuple(moved_by(o, moves) for o in other.slices)
        g._state.count = count
        host = self.host(g)
        for slot in self.plumbing[g].slots:
            host.__dict__[slot.attr] = slot.per_unit * count
        for sl in g.slices:
            owner, _, pname = sl.name.rpartition(".")
            sync_sizes(self.submodule(owner) if owner else self.model, pname)


def bind_constants(module: nn.Module, consts: list[ConstantSpec], count: int,
                   slots: list[ConstantSlot] | None = None) -> list[ConstantSlot]:
    """Make each count-dependent argument (a literal, or a size read that follows the units) a read of a plain
    attribute of the host, so an edit sets attributes instead of regenerating the host's code. Arguments of one
    per-unit size share one attribute (a slot); ``slots``, the group's slots so far, gains any new ones."""
    slots = [] if slots is None else slots
    seen = set()
    for c in consts:
        if (c.node, c.path) in seen:
            continue
        seen.add((c.node, c.path))
        slot = next((s for s in slots if s.per_unit == c.per_unit), None)
        if slot is None:
            k = sum(name.startswith(CONSTANT_PREFIX) for name in module.__dict__)
            slot = ConstantSlot(f"{CONSTANT_PREFIX}{k}", c.per_unit)
            module.__dict__[slot.attr] = c.per_unit * count
            slots.append(slot)
        with c.node.graph.inserting_before(c.node):
            read = c.node.graph.create_node("get_attr", slot.attr)
        set_path(c.node, c.path, read)
    return slots


def replace_data(t: torch.Tensor, data: torch.Tensor) -> None:
    """Swap in resized data, keeping the tensor object (optimizers and EMA copies point at it).

    autograd caches a parameter's gradient accumulator with the old shape and only drops it when
    dtype or device change, so pass through another dtype first; the stale ``.grad`` goes too."""
    if isinstance(t, nn.Parameter):
        t.grad = None
        other = torch.float16 if data.dtype != torch.float16 else torch.float32
        t.data = torch.empty(0, dtype=other, device=data.device)
    t.data = data
