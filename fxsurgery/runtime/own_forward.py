"""The host class's own forward, serving the calls no graph can take (a key/value cache, hooks inside the host).

It serves only where it follows the widths, which is checked on the host's template, never assumed: removing the
first units of every group (one, then two, and counts that differ between any two groups) must equal masking them,
on the analysed call. A group left with no units holds one unit whose tensors are zero for the call: it adds
nothing, as a removed unit does, and the host's code runs as it does with units (a view with a -1 fails on an empty
dim; a key/value cache passed or returned would store the group's empty tensors, and code reading its length off a
layer's keys takes an empty tensor for no entries: a graph returning a cache hands such calls to the own forward);
where the host's code fails even so, or differs from masking, its groups keep one unit. Code that keeps a count in a
plain attribute and reads it (a split size, a fused projection's output width) passes once those attributes follow
the count: the int attributes of the host's own modules, and of the plain objects they hold (a config), that are a
multiple of a group's count are the candidates, and the smallest set of them that passes both trials is kept (the
modules' own attributes searched first, a config's many ints only where none pass), set from the current widths for
every call the own forward serves and put back after it (an object such as a config is shared by every layer and the
model: each sees its own value). The taps still run, from pre-hooks on the groups' output projections (modules
there, not graph nodes).
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import types
from dataclasses import replace
from typing import Any, Callable, Iterator, NamedTuple

import torch
import torch.nn as nn

from ..analysis.verify import max_rel_diff
from ..capture.calls import materialize, training_mode
from ..compat import own_tensor_tables, tree_leaves
from ..dataflow.input_gathers import Gather, forward_gathered
from ..dataflow.paths import common_module, tensor_at, within
from ..dataflow.records import TapLayout
from ..errors import UnservedCall
from ..groups import GroupPlumbing
from ..module_sizes import sync_sizes
from ..slicing import ParamSlice, by_tensor, moved_by, solve_counts
from ..taps import TapPoint

MAX_TRIALS = 200  # sets of count attributes tried before the own forward is given up


class CountAttribute(NamedTuple):
    """A plain int attribute ``name`` of a module in the host, or of the object in its attribute ``holder`` (""
    for the module itself), that holds ``per_unit`` × the count of group ``group``."""

    module: str
    holder: str
    name: str
    group: int
    per_unit: int

    def owner(self, host: nn.Module) -> object:
        module = host.get_submodule(self.module)
        return getattr(module, self.holder) if self.holder else module


@contextlib.contextmanager
def counts_set(host: nn.Module, attributes: list[CountAttribute] | tuple[CountAttribute, ...],
               counts: list[int]) -> Iterator[None]:
    """For the call, each count attribute holds ``per_unit`` × its group's count in ``counts``; after it, the value
    it held (an object shared with the rest of the model, a config, holds its own value between calls)."""
    saved: list[tuple[object, str, int]] = []
    try:
        for c in attributes:
            owner = c.owner(host)
            value = getattr(owner, c.name)
            setattr(owner, c.name, c.per_unit * counts[c.group])
            saved.append((owner, c.name, value))  # once set (a frozen object refuses it)
        yield
    finally:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)


def current_counts(module: nn.Module, records: list[GroupPlumbing]) -> list[int]:
    """Each group's count now, read off its tensors' sizes (groups that share a dim, in segments of a fused
    projection, are told apart by ``slicing.solve_counts``)."""
    counts = solve_counts([r.slices for r in records], lambda name, dim: tensor_at(module, name).shape[dim])
    if counts is None:
        raise UnservedCall(f"the counts of the groups read by {', '.join(r.sink for r in records)} cannot be told "
                           "apart from their tensors' sizes")
    return counts


@contextlib.contextmanager
def _one_zero_unit(module: nn.Module, groups: list[GroupPlumbing], counts: list[int],
                   emptied: list[GroupPlumbing]) -> Iterator[None]:
    """For the call, each group in ``emptied`` (left with no units, which the host's own code cannot run: a view
    with a -1) holds one unit whose tensors are zero: its output columns are zero, so it adds nothing, as a removed
    unit does (removal equals masking). Its pieces go where one unit of it and the current counts of the others put
    them (a fused q/k/v projection's key rows after its query rows), filled in order along each dim."""
    held = [1 if r in emptied else count for r, count in zip(groups, counts)]
    moves = [(sl, (count - r.max_count) * sl.outer * sl.inner) for r, count in zip(groups, held) for sl in r.slices]
    with contextlib.ExitStack() as stack:
        for path, slices in by_tensor([moved_by(sl, moves) for r in emptied for sl in r.slices]):
            owner_path, _, name = path.rpartition(".")
            owner = module.get_submodule(owner_path)
            if owner is not module and type(_table(owner, name)[name]) not in (torch.Tensor, nn.Parameter):
                stack.enter_context(_padded_in_forward(owner, name, slices))
            else:
                stack.enter_context(_padded(_table(owner, name), name, slices))
        yield


def _table(owner: nn.Module, name: str) -> dict[str, torch.Tensor]:
    return next(t for t in own_tensor_tables(owner) if name in t)


@contextlib.contextmanager
def _padded(table: dict[str, torch.Tensor], name: str, slices: list[ParamSlice]) -> Iterator[None]:
    """``table[name]`` with one zero unit in each of its empty segments ``slices`` while the block runs."""
    kept = table[name]
    table[name] = _zero_units_added(slices, kept)
    try:
        yield
    finally:
        table[name] = kept


@contextlib.contextmanager
def _padded_in_forward(owner: nn.Module, name: str, slices: list[ParamSlice]) -> Iterator[None]:
    """``owner``'s tensor ``name`` padded as ``_padded`` does, but inside each of its forwards: a tensor subclass (a
    sharded tensor) is replaced there by the tensor its wrapper gathers for the forward, and put back after it."""
    kept: list[torch.Tensor] = []

    def pad(_module: nn.Module, _args: tuple) -> None:
        table = _table(owner, name)
        kept.append(table[name])
        table[name] = _zero_units_added(slices, table[name])

    def restore(_module: nn.Module, _args: tuple, _output: Any) -> None:
        _table(owner, name)[name] = kept.pop()  # before a wrapper's own hook puts its sharded tensor back

    handles = [owner.register_forward_pre_hook(pad), owner.register_forward_hook(restore, prepend=True)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _zero_units_added(slices: list[ParamSlice], t: torch.Tensor) -> torch.Tensor:
    """``t`` with one unit of zeros in each of its empty segments ``slices``, in order along each dim."""
    for sl in sorted(slices, key=lambda sl: (sl.dim, sl.start)):
        t = _zero_unit_added(replace(sl, after=t.shape[sl.dim] - sl.start), t)
    return t


def _zero_unit_added(sl: ParamSlice, t: torch.Tensor) -> torch.Tensor:
    """``t`` with one unit of zeros in the empty segment ``sl``."""
    units = sl.units(t, 0)
    return sl.append(t, 0, units.new_zeros([size for d, size in enumerate(units.shape) if d != sl.dim + 1]))


SERVING = "_fxsurgery_serving"  # on a host: how many calls of its own forward are running (they call its modules)


@contextlib.contextmanager
def own_code_serving(module: nn.Module, groups: list[GroupPlumbing],
                     counts: list[CountAttribute]) -> Iterator[list[GroupPlumbing]]:
    """While the host's modules run their own code on its compact tensors: its count attributes hold the current
    counts, an emptied group holds one zero unit (its code may not run at none), and the modules' guards let their
    calls pass. Yields the emptied groups."""
    now = current_counts(module, groups)
    emptied = [r for r, count in zip(groups, now) if count == 0]
    module.__dict__[SERVING] = module.__dict__.get(SERVING, 0) + 1
    try:
        with _one_zero_unit(module, groups, now, emptied), counts_set(module, counts, [max(n, 1) for n in now]):
            yield emptied
    finally:
        module.__dict__[SERVING] -= 1


class OwnForward:
    """The host class's forward with its count attributes set from the current widths and its taps run."""

    def __init__(self, groups: list[GroupPlumbing], counts: list[CountAttribute], template: nn.Module, *,
                 gathers: list[Gather]):
        self.groups = groups
        self.counts = counts
        self.gathers = gathers
        shared = _shared_dims(groups)
        # units read in a segment of the projection's input (a fused output projection): the layout a hook on it
        # would see moves with the other groups' counts
        self.segmented = [r for r in groups if any(sl.output and sl.name == r.sink and (sl.name, sl.dim) in shared
                                                   for sl in r.slices)]
        self.sinks = [(r.sink.rpartition(".")[0], r.tap_point, r.tap_layout) for r in groups
                      if _is_projection(template, r.sink) and r not in self.segmented]
        # heads that enter the others through a mixing map: a hook on the projection sees only their output
        self.unseen = [r for r in groups if any(sl.output and sl.name != r.sink for sl in r.slices)]

    def __call__(self, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        with own_code_serving(module, self.groups, self.counts) as emptied:
            return self._run(module, {r.tap_point for r in emptied}, args, kwargs)

    def refusal(self, module: nn.Module) -> str:
        """Why the own forward cannot serve a call now ("" if it can): a tap it would not run where it should (a tap
        of gradients runs nowhere in a call without them: generation under ``no_grad``)."""
        grad = torch.is_grad_enabled()
        tapped = [r.sink for r in self.unseen if module.__dict__[r.tap_point].active(grad)]
        if tapped:
            return (f"{type(module).__name__}'s own forward serves this call (see explain()), but the taps of the "
                    f"heads read by {tapped[0]} would not see them enter their mixing maps there")
        tapped = [r.sink for r in self.segmented if module.__dict__[r.tap_point].active(grad)]
        if tapped:
            return (f"{type(module).__name__}'s own forward serves this call (see explain()), but the taps of the "
                    f"units {tapped[0]} reads in a segment of its input would not see them there")
        return ""

    def _run(self, module: nn.Module, untapped: set[str], args: tuple, kwargs: dict) -> Any:
        """The class's forward with the taps run (but those of the groups in ``untapped``, which hold no unit)."""
        refusal = self.refusal(module)
        if refusal:
            raise UnservedCall(refusal)
        points = [(path, module.__dict__[attr], layout) for path, attr, layout in self.sinks if attr not in untapped]
        handles = [module.get_submodule(path).register_forward_pre_hook(_through(point, layout))
                   for path, point, layout in points if point.hooks]
        try:
            return forward_gathered(module, self.gathers, args, kwargs)
        finally:
            for handle in handles:
                handle.remove()


def fit_count_attributes(real: Callable[..., nn.Module], groups: list[GroupPlumbing],
                         calls: list[tuple[tuple, dict]], *, gathers: list[Gather]
                         ) -> tuple[list[CountAttribute] | None, str, str]:
    """The count attributes with which the class's forward follows the widths on every one of ``calls`` (the
    analysed call first; a later call the template cannot run is not checked) (``real(unit_scale=...)`` makes a copy of
    the host at its analysed widths, its parameters drawn small or at unit scale; ``gathers``: the module inputs it
    reads as the graphs do), or None and what went wrong without any; and what goes wrong with the groups that may be
    emptied left with no units, each holding one zero unit ("" if nothing). Small parameters make attention nearly
    uniform and a residual stream outweigh the heads, so a count read wrongly (a head size taken for another) may
    change the outputs by less than the tolerance: a removal is also checked on parameters at unit scale, wherever
    the outputs there are finite."""
    small, unit_scale = functools.partial(real, unit_scale=False), functools.partial(real, unit_scale=True)
    trials = [_Trial(small, groups, _removing(groups, k), gathers) for k in (1, 2)
              if any(r.max_count > k for r in groups)]
    trials += [_Trial(small, groups, removals, gathers) for removals in _told_apart(groups)]
    calls = [materialize(call) for call in calls]
    checks = [(trial, call, trial.expected(*call)) for call in calls for trial in trials]
    if any(expected is None for _, call, expected in checks if call is calls[0]):
        return None, "cannot run the call it was analysed on", ""
    checks = [check for check in checks if check[2] is not None]  # a later call the template cannot run
    if trials:  # one removal again on copies at unit scale, on every call whose outputs there are finite
        scaled = _Trial(unit_scale, groups, _removing(groups, 1), gathers)
        trials.append(scaled)
        for call in calls:
            expected = scaled.expected(*call)
            if expected is not None and _finite(expected):
                checks.append((scaled, call, expected))
    own, held = _candidates(trials[0].masked, groups) if trials else ([], [])
    chosen, fault = _fitting(own, checks, needs_held=False)
    if chosen is None:
        chosen = _fitting_locally(own, groups, checks)
    if chosen is None and held:  # the host's own attributes first: a held config adds many candidates
        chosen, _ = _fitting(own + held, checks, needs_held=True)
    if chosen is None:
        return None, fault, ""
    checks.clear()  # the trials' copies of the host freed before the empty trial makes its two
    trials.clear()
    empty = _Trial(small, groups, [r.max_count if r.min_count == 0 and r.exact else 0 for r in groups], gathers)
    return list(chosen), "", empty.run(chosen, *calls[0], empty.expected(*calls[0]) or [])


def _fitting(candidates: list[CountAttribute], checks: list, *, needs_held: bool
             ) -> tuple[tuple[CountAttribute, ...] | None, str]:
    """The smallest set of ``candidates`` with which every check passes, among the first ``MAX_TRIALS`` sets tried
    (with ``needs_held``, only sets that hold an attribute of a held object), or None; and what went wrong first."""
    fault, tried = "", 0
    for size in range(len(candidates) + 1):
        for chosen in itertools.combinations(candidates, size):
            if len({(c.module, c.holder, c.name) for c in chosen}) < size:
                continue  # one attribute follows one group
            if needs_held and all(not c.holder for c in chosen):
                continue  # tried already, among the host's own attributes
            why = _fault(chosen, checks)
            if not why:
                return chosen, ""
            fault = fault or why
            tried += 1
            if tried >= MAX_TRIALS:
                return None, fault
    return None, fault


def _fitting_locally(candidates: list[CountAttribute], groups: list[GroupPlumbing], checks: list
                     ) -> tuple[CountAttribute, ...] | None:
    """The attributes of some names, smallest sets of names first, within every group's own module (the innermost
    holding all its slices), with which the checks pass; or None. The search for a host whose groups keep their
    counts one per layer in attributes of one name (a model analysed as a whole), sets larger than ``_fitting``
    reaches in its trials. Its candidates also hold the count in a unit's own width (1, or a slice's elements of
    one unit): a larger search passes checks by chance more often (a head size that is a multiple of the count)."""
    homes = [common_module([sl.name.rpartition(".")[0] for sl in r.slices]) for r in groups]
    widths = [{1} | {sl.inner for sl in r.slices} | {sl.outer * sl.inner for sl in r.slices} for r in groups]
    local = list({(c.module, c.name): c for c in reversed(candidates) if not c.holder and c.per_unit in widths[c.group]
                  and within(c.module, homes[c.group])}.values())
    names = sorted({c.name for c in local})
    sets = (names_set for size in range(1, len(names) + 1) for names_set in itertools.combinations(names, size))
    for names_set in itertools.islice(sets, MAX_TRIALS):
        chosen = tuple(c for c in local if c.name in names_set)
        if not _fault(chosen, checks):
            return chosen
    return None


def _finite(tensors: list[torch.Tensor]) -> bool:
    """No floating or complex tensor holds an infinity or a NaN."""
    return all(bool(torch.isfinite(t).all()) for t in tensors if t.is_floating_point() or t.is_complex())


def _fault(chosen: tuple[CountAttribute, ...], checks: list) -> str:
    """What goes wrong first with ``chosen`` set in the checks ("" if nothing)."""
    return next((w for w in (t.run(chosen, *call, expected) for t, call, expected in checks) if w), "")


def _removing(groups: list[GroupPlumbing], k: int) -> list[int]:
    """``k`` units of every exact group that has more (a removal from an inexact one differs from masking by its
    nature, by more or less than the trials' tolerance as the call's values fall: no trial of a count attribute)."""
    return [k if r.exact and r.max_count > k else 0 for r in groups]


def _told_apart(groups: list[GroupPlumbing]) -> list[list[int]]:
    """Removals that give any two groups different counts in one of them (group ``i`` loses 1 + bit ``t`` of ``i``
    units in the ``t``-th), so that an attribute holding one group's count is not taken for another's that the
    uniform removals shrink alike (a decoder's self- and cross-attention heads)."""
    bits = (len(groups) - 1).bit_length()
    return [[min(1 + (i >> t & 1), r.max_count - 1) if r.exact else 0 for i, r in enumerate(groups)]
            for t in range(bits)]


class _Trial:
    """The template with the first ``removals[i]`` units of each group ``i`` masked, and a copy with them
    removed."""

    def __init__(self, real: Callable[[], nn.Module], groups: list[GroupPlumbing], removals: list[int],
                 gathers: list[Gather]):
        self.masked, self.removed, self.groups, self.gathers = real(), real(), groups, gathers
        slices = {i: r.slices for i, r in enumerate(groups)}  # segments move as the groups before them shrink
        for i, (r, n) in enumerate(zip(groups, removals)):
            if not n:
                continue
            with torch.no_grad():  # every point where the units enter the others
                for out in (sl for sl in r.slices if sl.output):
                    for unit in range(n):
                        out.unit(self.masked.get_parameter(out.name).data, r.max_count, unit).zero_()
            rest = torch.arange(n, r.max_count)
            for k in range(len(slices[i])):  # each piece moves the others' and the group's own later pieces
                sl = slices[i][k]
                move = [(sl, -n * sl.outer * sl.inner)]
                owner, _, name = sl.name.rpartition(".")
                holder = self.removed.get_submodule(owner)
                tensor = getattr(holder, name)
                tensor.data = sl.keep(tensor.data, r.max_count, rest)
                sync_sizes(holder, name)
                slices = {j: tuple(moved_by(o, move) for o in group) for j, group in slices.items()}

    def expected(self, args: tuple, kwargs: dict) -> list[torch.Tensor] | None:
        """The masked copy's output tensors on the call (None where it cannot run it)."""
        try:
            with training_mode(self.masked, False), torch.no_grad():
                out = forward_gathered(self.masked, self.gathers, args, kwargs)
        except Exception:  # a call the template cannot run tells nothing
            return None
        return [t for t in tree_leaves(out) if torch.is_tensor(t)]

    def run(self, counts: tuple[CountAttribute, ...], args: tuple, kwargs: dict,
            expected: list[torch.Tensor]) -> str:
        """What goes wrong with ``counts`` set on the removed copy ("" if its outputs equal the masked copy's,
        ``expected``)."""
        now = current_counts(self.removed, self.groups)
        emptied = [r for r, count in zip(self.groups, now) if count == 0]
        try:
            with _one_zero_unit(self.removed, self.groups, now, emptied), \
                    counts_set(self.removed, counts, [max(count, 1) for count in now]), \
                    training_mode(self.removed, False), torch.no_grad():
                out = forward_gathered(self.removed, self.gathers, args, kwargs)
        except Exception as e:  # any failure means the forward does not follow the widths
            return f"fails once a unit is removed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        err = max_rel_diff(expected, [t for t in tree_leaves(out) if torch.is_tensor(t)])
        return "" if err <= 1e-4 else f"reads a unit count it stores (a removal differs from masking by {err:.1e})"


def _candidates(host: nn.Module, groups: list[GroupPlumbing]) -> tuple[list[CountAttribute], list[CountAttribute]]:
    """Plain positive int attributes that are a multiple of a group's count: the host's own modules' (torch's
    modules keep theirs in step already), and those of the plain objects they hold (a config), each object once
    however many modules hold it."""
    own, held, seen = [], [], set()
    for path, m in host.named_modules():
        if type(m).__module__.startswith("torch."):
            continue
        own += _multiples(vars(m), groups, path=path, holder="")
        for holder, value in vars(m).items():
            if not holder.startswith("_") and _is_plain_object(value) and id(value) not in seen:
                seen.add(id(value))
                held += _multiples(vars(value), groups, path=path, holder=holder)
    return own, held


def _multiples(attributes: dict[str, Any], groups: list[GroupPlumbing], *, path: str,
               holder: str) -> list[CountAttribute]:
    """The count attributes among ``attributes`` (of the module at ``path`` or of the object in its ``holder``)."""
    return [CountAttribute(path, holder, name, i, value // r.max_count) for name, value in attributes.items()
            if not name.startswith("_") and type(value) is int and value > 0
            for i, r in enumerate(groups) if r.max_count > 1 and value % r.max_count == 0]


def _is_plain_object(value: Any) -> bool:
    """An instance that keeps its attributes in its own ``__dict__`` (not a module, tensor, class, function or
    Python module, whose attributes are no state of the host's)."""
    return (isinstance(getattr(value, "__dict__", None), dict) and not callable(value)
            and not isinstance(value, (nn.Module, torch.Tensor, types.ModuleType)))


def _shared_dims(groups: list[GroupPlumbing]) -> set[tuple[str, int]]:
    """The (tensor, dim) pairs that hold segments of several groups."""
    seen: dict[tuple[str, int], int] = {}
    for r in groups:
        for key in {(sl.name, sl.dim) for sl in r.slices}:
            seen[key] = seen.get(key, 0) + 1
    return {key for key, n in seen.items() if n > 1}


def _through(point: TapPoint, layout: TapLayout) -> Callable[[nn.Module, tuple], tuple]:
    def hook(projection: nn.Module, args: tuple) -> tuple:
        return (point(args[0], layout), *args[1:])
    return hook


def _is_projection(host: nn.Module, weight: str) -> bool:
    """The weight's owner is a leaf module holding only it and a bias (a Linear, a convolution, a Conv1D), so a
    pre-hook on it sees exactly the projection's input."""
    owner, _, name = weight.rpartition(".")
    module = host.get_submodule(owner)
    params = dict(module.named_parameters())
    return next(module.children(), None) is None and name in params and set(params) <= {name, "bias"}
