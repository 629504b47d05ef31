"""``analyse``: what fxsurgery finds in a model, as a value (``Analysis``) that ``Surgeon`` installs.

The analysis runs on a working copy of the model whose parameters share the model's storage (no memory) and
whose buffers are cloned, so tracing, the train-mode capture and the self-check's trial edits never touch the
model: it plans (``model.plan_model``), self-checks the first host of each kind on the copy (``install.check_hosts``)
and describes the groups that pass (``model.read_findings``). The value keeps the plan (the hosts, their graphs and
checks) so that ``Surgeon(model, analysis)`` installs it once, without tracing; pickling and copying drop the plan,
and a Surgeon given an analysis without it analyses the model again and checks that it finds the same.
"""
from __future__ import annotations

import copy
import dataclasses
import gc
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
import torch.nn as nn

from ..capture.calls import forked_rng, training_mode
from ..capture.front_ends import FrontEndUse
from ..capture.meta_memo import MetaMemo
from ..compat import own_module_table, own_tensor_tables, tree_map, version_counter
from ..errors import AnalysisError
from ..groups import GroupDescription, LeftOut
from ..runtime.call_signature import value_signature, without_objects
from .install import check_hosts
from .model import ModelPlan, plan_model, read_findings

Structure = tuple[tuple[str, str, tuple], ...]  # (module path, class, ((tensor, shape, dtype), ...)) per module


@dataclass(eq=False)
class Analysis:
    """The unit groups of a model called as ``model(*example_inputs, **example_kwargs)`` at their analysed
    counts, what was left out and why, and which front end recorded each host module.

    Two analyses are equal when they describe the same groups, left-out parts and front ends of models of the
    same structure called alike. Picklable; a pickled or copied analysis installs by analysing again. Until it is
    installed it holds the analysed copy, whose parameters share the model's storage as it was: an analysis kept
    after its model has been edited keeps that storage alive (a Surgeon keeps it without the plan)."""

    model_class: str
    structure: Structure
    groups: tuple[GroupDescription, ...]
    left_out: tuple[LeftOut, ...]
    front_ends: dict[str, FrontEndUse]
    example_inputs: tuple
    example_kwargs: dict[str, Any]
    _plan: ModelPlan | None = field(default=None, repr=False)

    def group(self, name: str) -> GroupDescription:
        for g in self.groups:
            if g.name == name:
                return g
        raise KeyError(f"no group named {name!r}; groups: {[g.name for g in self.groups]}")

    def without_plan(self) -> Analysis:
        """The same description without the install plan (what a pickle or copy holds): the plan's graphs hold the
        analysed copy, whose parameters share the storage the model had, and would keep it alive once installed."""
        return dataclasses.replace(self, _plan=None)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Analysis):
            return NotImplemented
        return self._key() == other._key()

    __hash__ = None  # mutable containers inside: equal, not hashable

    def __getstate__(self) -> dict[str, Any]:
        """The description without the install plan (graphs bound to the analysed copy's code)."""
        return {**self.__dict__, "_plan": None}

    def _key(self) -> tuple:
        left_out = tuple((lo.module, tuple(lo.reasons)) for lo in self.left_out)
        call = value_signature((self.example_inputs, self.example_kwargs))
        return self.model_class, self.structure, self.groups, left_out, tuple(self.front_ends.items()), call


def analyse(model: nn.Module, example_inputs: Any = (), example_kwargs: dict[str, Any] | None = None) -> Analysis:
    """Find the unit groups of ``model`` called as ``model(*example_inputs, **example_kwargs)``, leaving ``model``
    untouched (same forward, parameters, buffers and ``state_dict``). Every group offered has passed the
    self-check: a clone leaves the outputs unchanged and a removal equals masking the unit."""
    args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    kwargs = dict(example_kwargs or {})
    if not args and not kwargs:
        raise ValueError("analyse needs an example call of the model: example_inputs and/or example_kwargs")
    if torch.get_default_device().type == "meta":
        raise ValueError("the analysis runs inside a torch.device('meta') context, where the tensors it makes "
                         "would hold no values: build the model inside the context and analyse (or wrap) it outside")
    with collector_paused():
        working = working_copy(model)
        run_once(working, args, kwargs)
        plan = plan_model(working, (args, kwargs))
        plan.checks = check_hosts(working, plan)
        found = read_findings(plan)
        plan.placed = found.placed
    return Analysis(type(model).__name__, structure(model), tuple(found.groups), tuple(found.left_out),
                    found.front_ends, args, kwargs, plan)


def run_once(model: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
    """Call ``model`` once, in eval mode, without gradients, on a forked random stream, then put each module's mode
    back: a module that fills its state on its first call (a buffer computed lazily) is then captured, and
    installed, as it serves every later call, so an analysis does not depend on whether the model ran before. Eval
    mode leaves running statistics as they were: only state made on a first call changes. Where a run on the meta
    device shows that the call changes no state, the model is not run (a full forward saved twice per analysis)."""
    args, kwargs = without_objects((args, kwargs))
    tensors = [*model.parameters(), *model.buffers()]
    if any(t.is_meta for t in tensors):  # a model on the meta device computes nothing a first call could keep
        return
    if not _first_call_changes(model, args, kwargs):
        return
    modes = {module: module.training for module in model.modules()}
    try:
        with torch.no_grad(), forked_rng(tensors):
            model.eval()
            model(*args, **kwargs)  # the call as the analysis reads it: without objects, a cache the call would fill
    except Exception as err:
        raise AnalysisError(f"{type(model).__name__} cannot be called with the example call (in eval mode, "
                            f"without gradients): {type(err).__name__}: {err}") from err
    finally:
        for module, training in modes.items():
            module.training = training


def _first_call_changes(model: nn.Module, args: tuple, kwargs: dict[str, Any]) -> bool:
    """Whether calling ``model`` in eval mode changes its state: a run with every parameter and buffer on the meta
    device (shapes only) after which an attribute of a module, or of a plain object a module holds (a config), is
    another object (a buffer made anew), or a parameter or buffer was written in place; every attribute is then put
    back. True where the call does not run so (data-dependent code): the real call decides."""
    original = _attribute_tables(model)
    stand_ins: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for table in own_tensor_tables(module):
            for name, t in table.items():
                if t is not None:
                    table[name] = stand_ins.setdefault(id(t), _on_meta(t))
    swapped = _attribute_tables(model)
    versions = [(t, version_counter(t)) for t in stand_ins.values()]
    meta_args, meta_kwargs = tree_map(lambda t: t.to("meta") if torch.is_tensor(t) else t, (args, kwargs))
    try:
        with torch.no_grad(), forked_rng([]), training_mode(model, False), MetaMemo():
            model(*meta_args, **meta_kwargs)
        return any(version_counter(t) != version for t, version in versions) or any(
            table.keys() != entries.keys() or any(table[k] is not v for k, v in entries.items())
            for table, entries in swapped)
    except Exception:
        return True
    finally:
        for table, entries in original:
            table.clear()
            table.update(entries)


def _on_meta(t: torch.Tensor) -> torch.Tensor:
    meta = t.detach().to("meta")
    return nn.Parameter(meta, t.requires_grad) if isinstance(t, nn.Parameter) else meta


def _attribute_tables(model: nn.Module) -> list[tuple[dict, dict]]:
    """Each attribute table (``__dict__``; parameters, buffers and submodules) of every module of ``model`` and of the
    plain objects they hold, with a copy of its entries."""
    tables = {}
    for module in model.modules():
        held = [getattr(value, "__dict__", None) for value in vars(module).values()
                if not isinstance(value, (nn.Module, torch.Tensor, type))]
        for table in (vars(module), *own_tensor_tables(module), own_module_table(module), *held):
            if isinstance(table, dict):
                tables[id(table)] = (table, dict(table))
    return list(tables.values())


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused, then put back as it was: an analysis makes many objects that live
    until it ends (graphs, records), and each collection would walk every object of the process, the model's too.
    The cycles it leaves are collected later."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def working_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` whose parameters are new objects over the same storage (edits replace data, never
    write into it) and whose buffers are cloned (a train-mode capture updates running statistics)."""
    memo: dict[int, Any] = {id(b): b.clone() for b in model.buffers()}
    memo.update({id(p): nn.Parameter(p.detach(), requires_grad=p.requires_grad) for p in model.parameters()})
    try:
        return _copied(model, memo)
    except Exception as err:  # an attribute deepcopy cannot copy (a lock, a file handle)
        raise TypeError(f"fxsurgery analyses a copy of {type(model).__name__} so the model stays untouched, and "
                        f"the model cannot be copied: {type(err).__name__}: {err}") from err


def _copied(module: nn.Module, memo: dict[int, Any]) -> nn.Module:
    """``copy.deepcopy(module, memo)``, with a module's submodules copied alike and its empty tables (most of them
    hold no hooks) made anew: what copying a deep model spends most of its time on. A module that copies or pickles
    itself its own way is left to ``deepcopy``."""
    cls = type(module)
    if id(module) in memo:
        return memo[id(module)]
    if getattr(cls, "__deepcopy__", None) is not None or cls.__reduce_ex__ is not object.__reduce_ex__ \
            or cls.__reduce__ is not object.__reduce__ or cls.__getstate__ is not nn.Module.__getstate__:
        return copy.deepcopy(module, memo)
    new = cls.__new__(cls)
    memo[id(module)] = new
    state = {}
    for key, value in module.__getstate__().items():
        if key == "_modules":
            state[key] = type(value)((k, None if m is None else _copied(m, memo)) for k, m in value.items())
        elif type(value) in (dict, OrderedDict, set) and not value:
            state[key] = type(value)()
        else:
            state[key] = copy.deepcopy(value, memo)
    new.__setstate__(state)
    return new


def structure(model: nn.Module) -> Structure:
    """Each module's path, class and tensors (name, shape, dtype): what an installed plan relies on."""
    rows = []
    for name, module in model.named_modules():
        tensors = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        rows.append((name, type(module).__qualname__,
                     tuple((k, tuple(t.shape), str(t.dtype)) for k, t in tensors if t is not None)))
    return tuple(rows)


def structure_difference(expected: Structure, found: Structure) -> str:
    """The first module where ``found`` differs from ``expected``, in words."""
    for want, have in zip(expected, found):
        if want != have:
            return f"module {want[0] or '(model)'} was {want[1:]} and is {have[1:]}"
    return f"{len(expected)} modules were analysed and the model has {len(found)}"

