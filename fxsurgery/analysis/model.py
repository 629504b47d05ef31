"""Planning the analysis of a whole model: trace its regions, locate the hosts and analyse each kind of host
(``plan_model``); once the hosts are self-checked (``analysis.install.check_hosts``), ``read_findings`` reads the
groups offered and the parts left out from the plan alone, and places each group in its host for installing."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch.nn as nn

from ..capture.calls import capture_inputs
from ..capture.front_ends import FrontEndUse
from ..dataflow.grouping import GroupSpec
from ..dataflow.paths import common_module, join_path, within
from ..errors import AnalysisError, TraceError, unforeseen
from ..groups import GroupDescription, LeftOut
from ..reason import Reason
from ..runtime.call_signature import holds_objects, without_objects
from ..runtime.recapture import OwnForwardFit
from ..slicing import ParamSlice
from .cache import AnalysisCache
from .host import HostAnalysis, HostKey, analyse_host
from .regions import TraceFailure, find_regions, locate_hosts


@dataclass
class Findings:
    """The groups offered and the parts left out, in the order found."""

    groups: list[GroupDescription] = field(default_factory=list)
    left_out: list[LeftOut] = field(default_factory=list)
    front_ends: dict[str, FrontEndUse] = field(default_factory=dict)  # host module -> the front end that recorded it
    placed: dict[str, list[tuple[int, str]]] = field(default_factory=dict)  # host -> (index in its analysis, name)

    def leave_out(self, module: str, reasons: list[str]) -> None:
        """Report ``module`` as left out (once: a region and its host may find the same refusal)."""
        if LeftOut(module, reasons) not in self.left_out:
            self.left_out.append(LeftOut(module, reasons))


@dataclass(frozen=True)
class HostCheck:
    """One host as the self-check found it: its fingerprint, its analysis (or why it failed), the self-check outcome
    of each group layout (by the group's slices named within the host: None where it passed) and, for a host whose
    calls pass objects, the fit of its own forward. Hosts built alike share the outcomes and the fit."""

    key: HostKey
    found: HostAnalysis | Reason
    outcomes: dict[tuple, Reason | None]
    fit: OwnForwardFit | None


@dataclass
class ModelPlan:
    """What installing needs, found once: the hosts in the order the model runs them, each host's analysed call
    (object arguments left out) and whether it passes objects, the parts left out while locating the hosts,
    the regions that did not trace, the analyses hosts share, each installed host's check, in order (hosts inside
    one captured by another front end than the symbolic trace are not installed: the outer one serves them), and
    where ``read_findings`` placed each group offered (by host: its index in the host's analysis, and its name)."""

    model_name: str
    hosts: list[str]
    calls: dict[str, tuple[tuple, dict]]
    passes_objects: dict[str, bool]
    left_out: list[LeftOut]
    failures: list[TraceFailure]
    shared: AnalysisCache
    checks: dict[str, HostCheck] = field(default_factory=dict)
    placed: dict[str, list[tuple[int, str]]] = field(default_factory=dict)
    aliases: dict[str, tuple[str, ...]] = field(default_factory=dict)  # a tensor's names, where it has several


def plan_model(model: nn.Module, example: tuple[tuple, dict]) -> ModelPlan:
    """Trace ``model`` called as ``example`` (args, kwargs), locate the hosts and analyse each kind of host."""
    found = Findings()
    regions, failures = find_regions(model, example, found.leave_out)
    hosts, traced_calls = locate_hosts(model, regions, found.leave_out)
    plan = ModelPlan(type(model).__name__, [], {}, {}, found.left_out, failures, AnalysisCache(),
                     aliases=tensor_aliases(model))
    if hosts:
        # the hosts' calls, and their callers' (a host whose heads reach its outputs is replaced by its caller):
        # as the labelling of the traced graphs made them, else captured from a meta run of the model
        around = {".".join(host.split(".")[:depth]) for host in hosts for depth in range(1, host.count(".") + 2)}
        calls, missing = {}, []
        for name in sorted(around - {""}):
            try:
                calls[name] = traced_calls[name].values()
            except LookupError:  # not called in a traced graph, or with a value the labelling did not keep
                missing.append(name)
        calls.update(capture_inputs(model, example, missing) if missing else {})
        calls[""] = example
        # an object argument (a key/value cache) is no graph input: the analysis reads the call without it
        plan.calls = {name: without_objects(call) for name, call in calls.items()}
        # a host that is a container never called itself (a ModuleList whose blocks share a value) is its caller
        plan.hosts = _callers_of_returned_heads(model, _called(hosts, plan.calls), plan)
        plan.passes_objects = {host: holds_objects(calls[host]) for host in plan.hosts}
    return plan


def read_findings(plan: ModelPlan) -> Findings:
    """The groups the checked plan offers and the parts it leaves out, in the order found, read from the hosts'
    analyses, self-check outcomes and own-forward fits alone (nothing is installed or checked here)."""
    found = Findings(left_out=list(plan.left_out))
    for host, check in plan.checks.items():
        if isinstance(check.found, Reason):
            found.leave_out(host, [check.found.text])
            continue
        found.front_ends[host] = check.found.front_end
        for r in check.found.refusals:
            found.leave_out(join_path(host, common_module(r.modules)), r.reasons)
        _offer(found, host, check, plan.model_name, plan.aliases)
    # modules that did not trace: their parts were analysed on their own where they traced
    for name, err in plan.failures:
        found.leave_out(name, [str(err)])
    if not found.groups:
        failures = {str(err) for _, err in plan.failures}
        parts = [f"{lo.module}: {', '.join(lo.reasons)}" for lo in found.left_out if not set(lo.reasons) <= failures]
        if plan.failures:  # what did not trace, then why the parts that did were left out
            raise TraceError("; ".join([str(err) for _, err in plan.failures] + parts))
        why = "; ".join(parts) or "no attention heads or FFN channels"
        raise AnalysisError(f"no unit groups found in {plan.model_name}: {why}")
    return found


def _offer(found: Findings, host: str, check: HostCheck, model_name: str,
           aliases: dict[str, tuple[str, ...]]) -> None:
    """Offer the host's groups that pass (``offered``), each named in turn (a name taken by a group passing before,
    even one left out later as a partner, is not given again), with what its host's own forward asks of it."""
    offer = offered(host, check, aliases)
    taken = [g.name for g in found.groups]
    names = {}
    for index, hg in enumerate(check.found.groups):
        base = f"{group_module(host, hg.spec) or model_name}:{hg.spec.kind}"
        name = next(n for n in itertools.chain([base], (f"{base}{k}" for k in itertools.count(1))) if n not in taken)
        if index in offer.passed:
            taken.append(name)
            names[index] = name
    for lo in offer.left_out:
        found.leave_out(lo.module, lo.reasons)
    found.groups += [group_description(host, check.found.groups[index].spec, offer.slices[index], name=names[index],
                                       fit=check.fit) for index in offer.kept]
    found.placed[host] = [(index, names[index]) for index in offer.kept]


class Offer(NamedTuple):
    """A host's groups as offered: each group's slices (named within the model), the groups that pass their
    self-check and those offered (indices in the host's analysis), and why the others are left out."""

    slices: list[tuple[ParamSlice, ...]]
    passed: list[int]
    kept: list[int]
    left_out: list[LeftOut]


def offered(host: str, check: HostCheck, aliases: dict[str, tuple[str, ...]]) -> Offer:
    """The host's groups offered: those that pass their self-check and slice no tensor that code outside the host
    uses too (``aliases``: a module other blocks call), less those that share a dim with one left out (segments of
    one fused projection: the segments of a dim tile it, so its size tells their counts)."""
    specs = [hg.spec for hg in check.found.groups]
    slices = [group_slices(host, spec) for spec in specs]
    passed, left_out, lost = [], [], set()
    for index, spec in enumerate(specs):
        shared = shared_outside(host, slices[index], aliases)
        failure = check.outcomes[layout_within(host, slices[index])]
        if shared is None and failure is None:
            passed.append(index)
        else:
            reason = shared.text if shared is not None else f"self-check failed: {failure.text}"
            left_out.append(LeftOut(group_module(host, spec), [reason]))
            lost |= {(sl.name, sl.dim) for sl in slices[index]}
    kept = list(passed)
    while partners := [index for index in kept if any((sl.name, sl.dim) in lost for sl in slices[index])]:
        for index in partners:
            shared = next(sl.name for sl in slices[index] if (sl.name, sl.dim) in lost)
            left_out.append(LeftOut(group_module(host, specs[index]),
                                    [f"{shared}: shares a dim with a group left out, in segments"]))
            kept.remove(index)
            lost |= {(sl.name, sl.dim) for sl in slices[index]}
    return Offer(slices, passed, kept, left_out)


def tensor_aliases(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """Every name of each parameter or buffer that ``model`` holds under several (a module that several blocks
    call, tied weights), by each of those names."""
    names: dict[int, list[str]] = {}
    for name, tensor in itertools.chain(model.named_parameters(remove_duplicate=False),
                                        model.named_buffers(remove_duplicate=False)):
        names.setdefault(id(tensor), []).append(name)
    return {name: tuple(every) for every in names.values() if len(every) > 1 for name in every}


def shared_outside(host: str, slices: tuple[ParamSlice, ...],
                   aliases: dict[str, tuple[str, ...]]) -> Reason | None:
    """Why a group of ``host`` cannot be sliced: a tensor it slices is also a tensor of a module outside the host
    (whose graph does not see that use, so its analysis cannot tie the units there), or None."""
    for sl in slices:
        outside = [name for name in aliases.get(sl.name, ()) if host and not within(name, host)]
        if outside:
            users = sorted({name.rpartition(".")[0] for name in outside})
            return Reason(f"{sl.name} is also {outside[0]}, used by {', '.join(users)} outside {host}: a tensor "
                          "shared by layers cannot be sliced for one of them", module=host)
    return None


def group_module(host: str, spec: GroupSpec) -> str:
    """The module that holds the group: the deepest one holding all its modules."""
    return join_path(host, common_module(spec.modules))


def group_slices(host: str, spec: GroupSpec) -> tuple[ParamSlice, ...]:
    """The group's slices, named within the model."""
    return tuple(replace(m, name=join_path(host, m.name)) for m in spec.members)


def layout_within(host: str, slices: tuple[ParamSlice, ...]) -> tuple:
    """What decides a group's self-check outcome beside its host's key (identical code, layout and inputs give
    identical outcomes): its slices, named within the host."""
    return tuple(replace(sl, name=sl.name[len(host):]) for sl in slices)


def group_description(host: str, spec: GroupSpec, slices: tuple[ParamSlice, ...], *, name: str,
                      fit: OwnForwardFit | None) -> GroupDescription:
    """The description of ``spec``'s group as offered. A host whose own forward serves its calls (``fit``) notes where
    it cannot serve them at all, and keeps one unit at least where it cannot run a group with none."""
    notes, min_count = tuple(spec.notes), spec.min_count
    if fit is not None and fit.fault:
        notes += (f"calls that pass an object (a key/value cache) are refused: its host's own forward {fit.fault}",)
    elif fit is not None and fit.empty_fault and min_count == 0:
        min_count = 1
        notes += (f"keeps one unit: its host's own forward, which serves the calls that pass an object (a key/value "
                  f"cache), {fit.empty_fault} with none (holding one zero unit)",)
    return GroupDescription(name=name, kind=spec.kind, module=group_module(host, spec), max_count=spec.count,
                            exact=spec.exact, slices=slices, notes=notes, min_count=min_count)


def _nearest_called(name: str, calls: dict[str, tuple[tuple, dict]]) -> str:
    """Module ``name`` or its nearest ancestor that was called (containers such as ModuleList never are)."""
    while name and name not in calls:
        name = name.rpartition(".")[0]
    return name


def _called(hosts: list[str], calls: dict[str, tuple[tuple, dict]]) -> list[str]:
    """The hosts, each replaced by its nearest called module, in order, without repeats."""
    return list(dict.fromkeys(_nearest_called(host, calls) for host in hosts))


def _callers_of_returned_heads(model: nn.Module, hosts: list[str], plan: ModelPlan) -> list[str]:
    """The hosts, each one whose heads reach its outputs (an attention module that returns its per-head
    attention weights) replaced by its nearest calling module that drops them (a block may hand them on to its
    own caller), where that caller offers more groups than the hosts it replaces."""
    hosts = list(hosts)
    for host in list(hosts):
        if host not in hosts or not _hands_heads_on(model, host, plan):
            continue
        caller = host
        while caller and _hands_heads_on(model, caller, plan):
            caller = _nearest_called(caller.rpartition(".")[0], plan.calls)
        replaced = [h for h in hosts if within(h, caller)]
        if _group_count(model, caller, plan) > sum(_group_count(model, h, plan) for h in replaced):
            hosts = [h for h in hosts if h not in replaced] + [caller]
    return hosts


def _hands_heads_on(model: nn.Module, host: str, plan: ModelPlan) -> bool:
    """Whether the host's per-head values reach its outputs."""
    found = host_analysis(model, host, plan.calls[host], plan.shared)
    return not isinstance(found, Reason) and any(r.at_output for r in found.refusals)


def _group_count(model: nn.Module, host: str, plan: ModelPlan) -> int:
    found = host_analysis(model, host, plan.calls[host], plan.shared)
    return 0 if isinstance(found, Reason) else len(found.groups)


def host_analysis(model: nn.Module, host: str, inputs: tuple[tuple, dict],
                  shared: AnalysisCache) -> HostAnalysis | Reason:
    """The host's analysis (hosts built alike, every block of a ViT, are analysed once), or why it failed."""
    module = model.get_submodule(host) if host else model
    key = shared.key_of(module, host, inputs)
    if key not in shared.templates:
        try:
            shared.templates[key] = analyse_host(module, host, *inputs)
        except (TraceError, AnalysisError) as err:  # this host is left out; the others go on
            shared.templates[key] = Reason(str(err), module=host)
        except Exception as err:  # an unforeseen failure refuses this host, naming it, the error and where it arose
            what = f"analysing {host or 'the model'} ({type(module).__name__})"
            shared.templates[key] = Reason(unforeseen(what, err), module=host)
    return shared.templates[key]
