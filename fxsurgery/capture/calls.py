"""Running a model for the analysis without side effects: train/eval mode and random streams restored,
the calls of submodules recorded on the meta device, meta values made real where code needs data."""
from __future__ import annotations

import itertools
from contextlib import contextmanager
from typing import Any, Iterator

import torch
import torch.nn as nn

from ..compat import is_fake, own_tensor_tables, tree_leaves, tree_map
from ..errors import AnalysisError
from .meta_memo import MetaMemo


@contextmanager
def training_mode(module: nn.Module, mode: bool) -> Iterator[None]:
    """Temporarily put ``module`` (recursively) in train or eval mode, then restore every flag."""
    flags = [(m, m.training) for m in module.modules()]
    module.train(mode)
    try:
        yield
    finally:
        for m, f in flags:
            m.training = f


@contextmanager
def buffers_kept(module: nn.Module) -> Iterator[None]:
    """Run code on ``module`` and put every buffer back after it: values updated in place (a batch norm's
    statistics) and buffers the code replaced (a table cached at the first call), so later captures see the
    module as the caller gave it."""
    saved = [(owner, name, buffer, buffer.clone()) for owner in module.modules()
             for name, buffer in owner.named_buffers(recurse=False)]
    try:
        yield
    finally:
        with torch.no_grad():
            for owner, name, buffer, value in saved:
                if getattr(owner, name) is not buffer:
                    setattr(owner, name, buffer)
                buffer.copy_(value)


@contextmanager
def forked_rng(tensors: list[torch.Tensor]) -> Iterator[None]:
    """Analysis runs forwards; the user's random streams must not notice."""
    devices = sorted({t.device.index or 0 for t in tensors if torch.is_tensor(t) and t.is_cuda})
    with torch.random.fork_rng(devices=devices):
        yield


def materialize(obj: Any, seed: int = 0) -> Any:
    """Real tensors for meta ones (random floats, zeros otherwise; on the CPU) and for the fake ones a trace
    passes (at the trace's example sizes, on their device); real tensors pass as they are."""
    gen = torch.Generator().manual_seed(seed)

    def real(t: Any) -> Any:
        if not torch.is_tensor(t) or not (t.is_meta or is_fake(t)):
            return t
        shape = [example_size(size) for size in t.shape]
        device = "cpu" if t.is_meta else t.device
        if t.is_floating_point():
            return torch.randn(shape, generator=gen, dtype=t.dtype).to(device)
        return torch.zeros(shape, dtype=t.dtype, device=device)

    return tree_map(real, obj)


@contextmanager
def real_values(*modules: nn.Module) -> Iterator[None]:
    """Within the block, each meta parameter or buffer of ``modules`` is replaced, in its owner, by a real tensor of
    its shape and dtype on the CPU (random floats, zeros otherwise: ``materialize``); one tensor held by several
    owners (tied, or a graph module's copy of its root's) gets one real value everywhere, and the names it is read
    by still hold. Afterwards the meta ones are back."""
    made: dict[int, torch.Tensor] = {}
    replaced = []
    for owner in (m for module in modules for m in module.modules()):
        for table in own_tensor_tables(owner):
            for name, t in table.items():
                if t is not None and t.is_meta:
                    if id(t) not in made:
                        real = materialize(t.detach(), seed=len(made))
                        made[id(t)] = nn.Parameter(real, t.requires_grad) if isinstance(t, nn.Parameter) else real
                    replaced.append((table, name, t))
    for table, name, t in replaced:
        table[name] = made[id(t)]
    try:
        yield
    finally:
        for table, name, t in replaced:
            table[name] = t


def example_size(size: int | torch.SymInt) -> int:
    """A size as a plain int: a symbolic one (a trace's dynamic dim) at its value in the trace's example, read
    without adding a guard (2, which a call signature makes of every symbolic size, where it has none)."""
    if type(size) is int:
        return size
    hint = size.node.hint
    return 2 if hint is None else int(hint)


def capture_inputs(model: nn.Module, example: tuple[tuple, dict], names: list[str]) -> dict[str, tuple[tuple, dict]]:
    """Run ``model`` once on the meta device (shapes only) on the ``example`` call (args, kwargs) and record
    the (args, kwargs) of the first call of each named submodule; falls back to a real run for data-dependent
    models."""
    seen: dict[str, tuple[tuple, dict]] = {}
    handles = [model.get_submodule(name).register_forward_pre_hook(_recorder(seen, name), with_kwargs=True)
               for name in names]
    state = meta_state(model)
    meta_args, meta_kwargs = tree_map(lambda t: t.to("meta") if torch.is_tensor(t) else t, example)
    try:
        with torch.no_grad(), forked_rng(_tensors(example)):
            try:
                with MetaMemo():  # blocks built alike: their shapes are worked out once
                    torch.func.functional_call(model, state, meta_args, meta_kwargs)
            except Exception:
                seen.clear()
                with buffers_kept(model), real_values(model):  # a meta model: on random values of its shapes
                    try:
                        model(*materialize(example[0]), **materialize(example[1]))
                    except Exception as err:  # the model's own code refuses the call in this mode
                        mode = "train" if model.training else "eval"
                        raise AnalysisError(f"{type(model).__name__} cannot be called with the example call (in "
                                            f"{mode} mode): {type(err).__name__}: {err}") from err
    finally:
        for h in handles:
            h.remove()
    return seen


def attributes_read(module: nn.Module, args: tuple, kwargs: dict) -> set[tuple[str, str]] | None:
    """The plain attributes (path of the submodule, name) that ``module``'s code reads when called with ``args`` and
    ``kwargs``, in train and in eval mode: a run on the meta device (shapes only) during which each submodule's
    class is a subclass that notes every read of an attribute of its instance ``__dict__``. None where the call
    does not run so (then every attribute counts)."""
    paths = {id(m): name for name, m in module.named_modules()}
    reads: set[tuple[str, str]] = set()
    swapped = [(m, type(m)) for m in module.modules()]
    meta_args, meta_kwargs = tree_map(lambda t: t.to("meta") if torch.is_tensor(t) else t, (args, kwargs))
    try:
        for m, cls in swapped:
            m.__class__ = _noting(cls)
        _NOTING.append((reads, paths))
        with torch.no_grad(), MetaMemo():  # blocks built alike: their shapes are worked out once
            for mode in (True, False):
                with training_mode(module, mode):
                    torch.func.functional_call(module, meta_state(module), meta_args, meta_kwargs)
    except Exception:  # data-dependent code, a class that cannot be subclassed: every attribute counts
        return None
    finally:
        if _NOTING and _NOTING[-1][0] is reads:
            _NOTING.pop()
        for m, cls in swapped:
            m.__class__ = cls
    return reads


_NOTING: list[tuple[set[tuple[str, str]], dict[int, str]]] = []  # the reads being noted, innermost last
_NOTING_CLASSES: dict[type, type] = {}


def _noting(cls: type) -> type:
    """``cls`` with every read of an instance attribute noted in the innermost ``_NOTING`` (one subclass per class,
    named and placed as ``cls`` so that tracers treat it alike)."""
    if cls not in _NOTING_CLASSES:
        def __getattribute__(self: Any, name: str) -> Any:
            if _NOTING and name in object.__getattribute__(self, "__dict__"):
                reads, paths = _NOTING[-1]
                reads.add((paths.get(id(self), ""), name))
            return cls.__getattribute__(self, name)

        _NOTING_CLASSES[cls] = type(cls.__name__, (cls,), {"__getattribute__": __getattribute__,
                                                           "__module__": cls.__module__,
                                                           "__qualname__": cls.__qualname__})
    return _NOTING_CLASSES[cls]


def _recorder(seen: dict[str, tuple[tuple, dict]], name: str) -> Any:
    """A forward pre-hook that keeps the first (args, kwargs) the module ``name`` is called with."""
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        seen.setdefault(name, (args, kwargs))
    hook.fxsurgery_internal = True  # not a hook an installed graph must honour (``hooked_submodules``)
    return hook


def meta_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``module`` on the meta device, under every name it has: a module shared
    by two parents must be swapped under both names, or ``functional_call`` leaves a plain tensor behind."""
    named = itertools.chain(module.named_parameters(remove_duplicate=False),
                            module.named_buffers(remove_duplicate=False))
    return {k: v.to("meta") for k, v in named}


def _tensors(obj: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(obj) if torch.is_tensor(t)]
