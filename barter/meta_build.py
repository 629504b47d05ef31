"""A model built on the meta device, and later given the very values its build on the CPU would have drawn, at the
wrap's compact widths and in each process's own shards: FSDP2 training of a model no process could hold whole.

`record_build(build)` runs `build()` as it runs on the CPU, except that every tensor with elements it makes is on
the meta device, and records every op on meta tensors (the parameters' creation and initialisation, random draws
included) with the CPU generator's state at the start and at each draw (a build may seed it).
After `barter.wrap` (on meta) and `fully_shard`, `materialise` allocates the model on its device (`to_empty`) and
replays the record on the CPU from that generator state: the same draws in the same order, so the same numbers.
Each parameter and buffer is written as soon as its last op has run (the units the wrap kept, then the process's
own shard) and its values are dropped; values that a later op overwrites whole are never held (a random draw still
runs, on scratch, for the generator's sake). A process so holds about one tensor at full width at a time, not the
model.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode

from .compat import DispatchRecorder, device_constructors, tree_leaves, tree_map, written_arguments

IS_META = torch.Tensor.is_meta.__get__  # the getter a build asks before it skips an initialiser on meta tensors
# in-place ops whose result ignores the values they write over
OVERWRITES = (torch.ops.aten.fill_, torch.ops.aten.zero_, torch.ops.aten.copy_)


@dataclass(frozen=True)
class MetaView:
    """A meta tensor as an op saw it: its storage (held, so that its key stays its own) and where in it the tensor
    lies. A frozen record, as the wrap later resizes the tensors themselves."""

    storage: torch.UntypedStorage
    key: StorageWeakRef
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    @classmethod
    def of(cls, t: Tensor) -> MetaView:
        storage = t.untyped_storage()
        return cls(storage, StorageWeakRef(storage), t.dtype, tuple(t.shape), tuple(t.stride()), t.storage_offset())

    def whole(self) -> bool:
        """Whether the tensor covers its storage, element by element in order."""
        contiguous = torch.empty(0, device="meta").set_(self.storage, 0, self.shape, self.stride).is_contiguous()
        size = math.prod(self.shape) * self.dtype.itemsize
        return self.offset == 0 and contiguous and size == self.storage.nbytes()


@dataclass(frozen=True)
class RecordedOp:
    """One op of the build on meta tensors: its arguments (meta tensors as `MetaView`s, real ones as they were
    then), the meta tensors it returned, those it wrote in place, and whether it fills one of them whole without
    reading what it held (a random draw, a fill, a copy)."""

    func: Any  # the ATen op (an OpOverload)
    args: tuple
    kwargs: dict
    outputs: tuple[MetaView, ...]
    writes: tuple[MetaView, ...]
    overwrites: bool
    rng_state: Tensor | None  # a random op's: the CPU generator's state as the build reached it (seeded in it, say)

    @property
    def views(self) -> list[MetaView]:
        return [v for v in tree_leaves((self.args, self.kwargs)) if isinstance(v, MetaView)] + list(self.outputs)

    def made(self) -> set[StorageWeakRef]:
        """The storages the op writes: those of the arguments it writes in place and of the tensors it makes."""
        inputs = {v.key for v in tree_leaves((self.args, self.kwargs)) if isinstance(v, MetaView)}
        return {v.key for v in self.outputs} - inputs | {v.key for v in self.writes}


@dataclass(frozen=True)
class Replayed:
    """What `materialise` did: the ops it replayed, the most bytes of values it held at once (a whole tensor and
    its scratch, not the model) and the bytes of the model's values at full width."""

    ops: int
    peak_bytes: int
    model_bytes: int


@dataclass
class BuildRecord:
    """What `record_build` saw: the ops, the CPU generator's state before and after them, and where the build left
    each parameter and buffer (by name, at full width)."""

    ops: list[RecordedOp]
    rng_state: Tensor
    end_rng_state: Tensor
    tensors: dict[str, MetaView] = field(default_factory=dict)


class _AsOnTheCpu(TorchFunctionMode):
    """The build runs as it runs on the CPU, but every tensor with elements that it makes is on the meta device.
    Asked whether a tensor is on meta, or which device it builds on (a tensor with no elements, made where the
    build makes its tensors: transformers asks so), it hears "no" and "the CPU": an initialiser that skips meta
    tensors (torch's `nn.init.orthogonal_`) then runs and is recorded, or fails where it reads what it drew."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func == IS_META:
            return False
        if func in device_constructors() and kwargs.get("device") is None:
            made = func(*args, **{**kwargs, "device": torch.device("meta")})
            return made if made.numel() else func(*args, **kwargs)
        return func(*args, **kwargs)


def _on_meta(value: Any) -> bool:
    """Whether `value` is a tensor on the meta device (asked of its device: `is_meta` is seen as False here)."""
    return isinstance(value, Tensor) and value.device.type == "meta"


class _Recorder(DispatchRecorder):
    """Runs each op as it is and keeps those that touch a meta tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[RecordedOp] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if any(_on_meta(t) for t in (*tree_leaves((args, kwargs)), *tree_leaves(out))):
            writes = tuple(MetaView.of(t) for t in written_arguments(func, args, kwargs) if _on_meta(t))
            frozen = tree_map(_frozen, (args, kwargs))
            outputs = tuple(MetaView.of(t) for t in tree_leaves(out) if _on_meta(t))
            overwrites = _overwrites(func, writes, [v for v in tree_leaves(frozen) if isinstance(v, MetaView)])
            rng_state = torch.get_rng_state() if is_seeded_op(func) else None
            self.ops.append(RecordedOp(func, frozen[0], frozen[1], outputs, writes, overwrites, rng_state))
        return out


def _frozen(value: Any) -> Any:
    """An argument as the op saw it: a meta tensor's view, a copy of a real one."""
    if isinstance(value, Tensor):
        return MetaView.of(value) if _on_meta(value) else value.clone()
    return value


def _overwrites(func: Any, writes: tuple[MetaView, ...], inputs: list[MetaView]) -> bool:
    """Whether an op fills the one tensor it writes whole without reading what it held."""
    if len(writes) != 1 or not (func.overloadpacket in OVERWRITES or is_seeded_op(func)) or not writes[0].whole():
        return False
    return sum(v.key == writes[0].key for v in inputs) == 1


class MetaBuildError(RuntimeError):
    """A build that cannot run on the meta device (it reads a value of a tensor it made)."""


def record_build(build: Callable[[], nn.Module]) -> tuple[nn.Module, BuildRecord]:
    """`build()` on the meta device, and the record `materialise` replays; MetaBuildError for a build that reads a
    value of a tensor it made."""
    rng_state = torch.get_rng_state()
    recorder = _Recorder()
    try:
        with _AsOnTheCpu(), recorder:
            model = build()
    except (NotImplementedError, RuntimeError) as e:
        raise MetaBuildError(f"the model cannot be built on the meta device (its build reads a value of a tensor it "
                             f"made, as a draw by rejection does: {str(e).splitlines()[0]}); build it whole on every "
                             "process instead") from e
    tensors = {**dict(model.named_parameters(remove_duplicate=False)),
               **dict(model.named_buffers(remove_duplicate=False))}
    return model, BuildRecord(recorder.ops, rng_state, torch.get_rng_state(),
                              {name: MetaView.of(t) for name, t in tensors.items()})


def kept_positions(groups: Sequence[Any], kept: Mapping[str, Sequence[int]],
                   shapes: Mapping[str, Sequence[int]]) -> dict[str, list[Tensor | None]]:
    """For each tensor a group slices, the positions along each dim that the wrap's compact initialisation kept
    (None: the whole dim), from the groups as analysed (full width) and `kept`, the units each kept (in order; a
    group not named keeps all)."""
    masks: dict[str, list[Tensor | None]] = {}
    for group in groups:
        if group.name not in kept:
            continue
        if list(kept[group.name]) != sorted(kept[group.name]):
            raise ValueError(f"{group.name}: the units kept, {list(kept[group.name])}, are not in order")
        dropped = torch.tensor(sorted(set(range(group.count)) - set(kept[group.name])), dtype=torch.long)
        for sl in group.slices:
            if sl.name not in shapes:
                continue
            dims = masks.setdefault(sl.name, [None] * len(shapes[sl.name]))
            if dims[sl.dim] is None:
                dims[sl.dim] = torch.ones(shapes[sl.name][sl.dim], dtype=torch.bool)
            probe = dims[sl.dim].view([-1 if d == sl.dim else 1 for d in range(len(shapes[sl.name]))])
            sl.units(probe, group.count).index_fill_(sl.dim + 1, dropped, False)
    return {name: [None if m is None else m.nonzero().flatten() for m in dims] for name, dims in masks.items()}


def materialise(model: nn.Module, record: BuildRecord, device: torch.device | str, *,
                controller: Any = None) -> Replayed:
    """Allocate `model` on `device` (`to_empty`) and write into each of its parameters and buffers (each process
    its own shard of a sharded one) the values of the build `record` holds, replayed on the CPU from its generator
    state, at the units `controller` (the `barter.wrap` of the model, or of a submodule, on meta, if any) kept. The
    generator is left as the build on the CPU would have left it where nothing has used it since the build on meta,
    else as it is."""
    positions = {}
    if controller is not None:  # its groups name tensors from the module it wrapped, which may be a submodule
        prefix = next(f"{path}." if path else "" for path, module in model.named_modules()
                      if module is controller.model)
        shapes = {name[len(prefix):]: view.shape for name, view in record.tensors.items() if name.startswith(prefix)}
        kept = kept_positions(controller.surgeon.analysis.groups, controller.initial_units, shapes)
        positions = {prefix + name: index for name, index in kept.items()}
    found = torch.get_rng_state()
    ties = _ties(model)
    model.to_empty(device=device)
    for holders in ties:
        first = getattr(*holders[0])
        for module, name in holders[1:]:
            setattr(module, name, first)  # `to_empty` gives each holder of a tied parameter its own
    live = {**dict(model.named_parameters(remove_duplicate=False)),
            **dict(model.named_buffers(remove_duplicate=False))}
    missing = sorted(set(record.tensors) - set(live))
    if missing:
        raise ValueError(f"the model has lost {missing} since its build was recorded")
    replayed = replay(record, lambda name, full: _write(live[name], _keep(full, positions.get(name))))
    if controller is not None:
        restore_installed(controller, model)
    if not torch.equal(found, record.end_rng_state):
        torch.set_rng_state(found)  # used since the build (seeded again, say): as it was
    return replayed


def restore_installed(controller: Any, model: nn.Module) -> None:
    """Write into `model` (which holds `controller.model`, the module `barter.wrap` wrapped on the meta device,
    allocated since) the buffers the wrap's install added to it (`fxsurgery.Surgeon.installed_state`: which of a
    module input's entries a layer's units read), at the units the wrap kept: no build made them."""
    prefix = next(f"{path}." if path else "" for path, module in model.named_modules() if module is controller.model)
    full = controller.surgeon.installed_state()
    kept = kept_positions(controller.surgeon.analysis.groups, controller.initial_units,
                          {name: values.shape for name, values in full.items()})
    for name, values in full.items():
        buffer = model.get_buffer(prefix + name)
        _write(buffer, _keep(values, kept.get(name)).to(buffer.device))


def replay(record: BuildRecord, write: Callable[[str, Tensor], None]) -> Replayed:
    """Run the build `record` holds again on the CPU, from its generator state, calling `write(name, values)` with
    each parameter's and buffer's values at full width as soon as they are final (then dropped)."""
    replaying = _Replay(record, write)
    replaying.run()
    model_bytes = sum(math.prod(view.shape) * view.dtype.itemsize
                      for view in {view.key: view for view in record.tensors.values()}.values())
    return Replayed(len(record.ops), replaying.peak_bytes, model_bytes)


class _Replay:
    """The record's ops run again on CPU tensors that stand in for the meta ones, storage by storage."""

    def __init__(self, record: BuildRecord, write: Callable[[str, Tensor], None]) -> None:
        self.record = record
        self.write = write
        self.storages: dict[StorageWeakRef, torch.UntypedStorage] = {}
        self.finals: dict[StorageWeakRef, list[str]] = {}
        for name, view in record.tensors.items():
            self.finals.setdefault(view.key, []).append(name)
        self.last_use: dict[StorageWeakRef, int] = {}
        for i, op in enumerate(record.ops):
            self.last_use.update((view.key, i) for view in op.views)
        self.dead = _dead_ops(record.ops)
        self.peak_bytes = 0

    def run(self) -> None:
        torch.set_rng_state(self.record.rng_state)
        self.seen_rng_state = self.record.rng_state
        for key in set(self.finals) - set(self.last_use):  # made by no recorded op: as the build left it, unset
            self._finish(key)
        for i, op in enumerate(self.record.ops):
            if not op.func.is_view:
                self._step(i, op)
            for key in {view.key for view in op.views}:
                if self.last_use[key] == i:
                    self._finish(key)
        self._follow_generator(self.record.end_rng_state)

    def _follow_generator(self, recorded: Tensor) -> None:
        """Where the build changed the generator between two draws (seeded it), change it alike: a draw on meta
        leaves it as it was, so a state other than the last one recorded came from the build itself."""
        if not torch.equal(recorded, self.seen_rng_state):
            torch.set_rng_state(recorded)
            self.seen_rng_state = recorded

    def _step(self, i: int, op: RecordedOp) -> None:
        dead = i in self.dead
        if op.rng_state is not None:
            self._follow_generator(op.rng_state)
        elif dead:
            return  # its values are overwritten whole before anything reads them
        scratch: dict[StorageWeakRef, torch.UntypedStorage] = {}
        args, kwargs = tree_map(lambda v: self._stand_in(v, scratch if dead else self.storages), (op.args, op.kwargs))
        result = op.func(*args, **kwargs)
        self._held(sum(storage.nbytes() for storage in scratch.values()))
        if dead:
            return  # run for the generator's sake only
        for view, real in zip(op.outputs, (t for t in tree_leaves(result) if isinstance(t, Tensor))):
            if view.key not in self.storages:
                self.storages[view.key] = real.untyped_storage()
                self._held(0)

    def _stand_in(self, value: Any, storages: dict[StorageWeakRef, torch.UntypedStorage]) -> Any:
        """The CPU tensor for a meta one (its storage's, allocated unset on first use), the CPU for the meta
        device; anything else as recorded."""
        if isinstance(value, torch.device) and value.type == "meta":
            return torch.device("cpu")
        if not isinstance(value, MetaView):
            return value
        if value.key not in storages:
            storages[value.key] = self.storages.get(value.key) or torch.UntypedStorage(value.storage.nbytes())
            self._held(0)
        return torch.empty(0, dtype=value.dtype).set_(storages[value.key], value.offset, value.shape, value.stride)

    def _held(self, scratch_bytes: int) -> None:
        """Note the bytes held now: the stand-ins' and `scratch_bytes` more."""
        held = sum(storage.nbytes() for storage in self.storages.values())
        self.peak_bytes = max(self.peak_bytes, held + scratch_bytes)

    def _finish(self, key: StorageWeakRef) -> None:
        """Write the parameters and buffers on storage `key`, then drop its values."""
        for name in self.finals.get(key, []):
            self.write(name, self._stand_in(self.record.tensors[name], self.storages))
        self.storages.pop(key, None)


def _dead_ops(ops: list[RecordedOp]) -> set[int]:
    """The ops whose every write is overwritten whole before anything reads it (found backwards: a storage's values
    matter before an op that reads them, not before one that fills the storage whole without reading it)."""
    overwritten: set[StorageWeakRef] = set()  # storages whose values, at this point, nothing will read
    dead = set()
    for i in range(len(ops) - 1, -1, -1):
        op = ops[i]
        if op.func.is_view:
            continue
        made = op.made()
        if made and made <= overwritten:
            dead.add(i)
            continue
        filled = op.writes[0].key if op.overwrites else None
        read = {v.key for v in tree_leaves((op.args, op.kwargs)) if isinstance(v, MetaView)} - {filled}
        overwritten = (overwritten | ({filled} if filled is not None else set()) | (made - {filled})) - read
    return dead


def _ties(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """The modules and attribute names that hold one parameter, for each parameter held by more than one."""
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False, remove_duplicate=False):
            holders.setdefault(id(param), []).append((module, name))
    return [held for held in holders.values() if len(held) > 1]


def _keep(full: Tensor, positions: list[Tensor | None] | None) -> Tensor:
    """The positions kept along each dim of `full`."""
    for dim, index in enumerate(positions or []):
        if index is not None:
            full = full.index_select(dim, index)
    return full


@torch.no_grad()
def _write(target: Tensor, values: Tensor) -> None:
    """`values` into `target`, a plain tensor or this process's shard of a sharded one."""
    if tuple(target.shape) != tuple(values.shape):
        raise ValueError(f"the model holds a {tuple(target.shape)} tensor where its build made {tuple(values.shape)}")
    if isinstance(target, DTensor):
        shard = distribute_tensor(values.to(target.device), target.device_mesh, target.placements, src_data_rank=None)
        target.to_local().copy_(shard.to_local())
    else:
        target.copy_(values)


def is_seeded_op(op: Any) -> bool:
    """Whether an ATen op draws from a random generator."""
    return torch.Tag.nondeterministic_seeded in op.tags
