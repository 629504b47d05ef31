"""Analysing a whole model: trace its regions, locate the hosts, install each host's rewritten graphs,
and offer every group that passes the self-check."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace

import torch.nn as nn

from ..capture.calls import capture_inputs
from ..capture.front_ends import FrontEnd, FrontEndUse
from ..dataflow.grouping import GroupSpec
from ..dataflow.paths import common_module, join_path, within
from ..editing import CONSTANT_PREFIX, Editor, bind_constants
from ..errors import AnalysisError, TraceError, unforeseen
from ..groups import GroupPlumbing, LeftOut, UnitGroup
from ..reason import Reason
from ..runtime.call_signature import holds_objects, without_objects
from ..runtime.graph_forward import GraphForward
from ..runtime.own_forward import GroupRecord
from ..runtime.recapture import HostServer, OwnForwardFit, meta_template
from ..taps import POINT_PREFIX, TapPoint, insert_tap_point
from .cache import AnalysisCache, BoundGraphs
from .host import HostAnalysis, HostGroup, HostKey, analyse_host
from .regions import TraceFailure, find_regions, locate_hosts
from .verify import self_check


@dataclass
class Findings:
    """The groups offered and the parts left out, in the order found."""

    groups: list[UnitGroup] = field(default_factory=list)
    left_out: list[LeftOut] = field(default_factory=list)
    front_ends: dict[str, FrontEndUse] = field(default_factory=dict)  # host module -> the front end that recorded it

    def leave_out(self, module: str, reasons: list[str]) -> None:
        """Report ``module`` as left out (once: a region and its host may find the same refusal)."""
        if LeftOut(module, reasons) not in self.left_out:
            self.left_out.append(LeftOut(module, reasons))


@dataclass
class ModelPlan:
    """What installing needs, found once: the hosts in the order the model runs them, each host's analysed call
    (object arguments left out) and whether it passes objects, the parts left out while locating the hosts,
    the regions that did not trace, and the analyses hosts share."""

    hosts: list[str]
    calls: dict[str, tuple[tuple, dict]]
    passes_objects: dict[str, bool]
    left_out: list[LeftOut]
    failures: list[TraceFailure]
    shared: AnalysisCache


def plan_model(model: nn.Module, example: tuple[tuple, dict]) -> ModelPlan:
    """Trace ``model`` called as ``example`` (args, kwargs), locate the hosts and analyse each kind of host."""
    found = Findings()
    regions, failures = find_regions(model, example, found.leave_out)
    hosts, traced_calls = locate_hosts(model, regions, found.leave_out)
    plan = ModelPlan([], {}, {}, found.left_out, failures, AnalysisCache())
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


def install_model(model: nn.Module, plan: ModelPlan, editor: Editor, install_alike: bool = True) -> Findings:
    """Install the plan's hosts on ``model`` (the model planned, or one built alike) and offer every group that
    passes the self-check; their plumbing goes to ``editor``. Without ``install_alike``, a host built alike as one
    installed before is not installed, only its groups offered by that host's outcomes (what an analysis needs of
    its working copy, whose hosts run only for the self-check)."""
    findings = Findings(left_out=list(plan.left_out))
    installer = _Installer(model, editor, findings, plan.shared, install_alike)
    for host in plan.hosts:
        # a host inside a module kept whole by the symbolic trace is seen by an outer host captured otherwise
        if any(host != outer and within(host, outer) and use.front_end is not FrontEnd.SYMBOLIC
               for outer, use in findings.front_ends.items()):
            continue
        installer.install(host, plan.calls[host], passes_objects=plan.passes_objects[host])
    # modules that did not trace: their parts were analysed on their own where they traced
    for name, err in plan.failures:
        findings.leave_out(name, [str(err)])
    if not findings.groups:
        failures = {str(err) for _, err in plan.failures}
        parts = [f"{lo.module}: {', '.join(lo.reasons)}" for lo in findings.left_out if not set(lo.reasons) <= failures]
        if plan.failures:  # what did not trace, then why the parts that did were left out
            raise TraceError("; ".join([str(err) for _, err in plan.failures] + parts))
        why = "; ".join(parts) or "no attention heads or FFN channels"
        raise AnalysisError(f"no unit groups found in {type(model).__name__}: {why}")
    return findings


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


class _Installer:
    """Installs hosts one by one; hosts built alike share one analysis and one self-check outcome."""

    def __init__(self, model: nn.Module, editor: Editor, findings: Findings, shared: AnalysisCache,
                 install_alike: bool = True):
        self.model, self.editor, self.findings, self.shared = model, editor, findings, shared
        self.install_alike = install_alike
        self.installed: set[HostKey] = set()  # fingerprints of the hosts installed so far

    def install(self, host: str, inputs: tuple[tuple, dict], *, passes_objects: bool) -> None:
        """Install the host's graphs and offer its groups that pass the self-check. A host whose calls pass an
        object is served by its own forward: where that cannot run a group with no units, the group keeps one."""
        module = self.model.get_submodule(host) if host else self.model
        key = self.shared.key_of(module, host, inputs)
        template = host_analysis(self.model, host, inputs, self.shared)
        if isinstance(template, Reason):
            self.findings.leave_out(host, [template.text])
            return
        self.findings.front_ends[host] = template.front_end
        for r in template.refusals:
            self.findings.leave_out(join_path(host, common_module(r.modules)), r.reasons)
        if not self.install_alike and key in self.installed and key in self.shared.checked \
                and (not passes_objects or key in self.shared.own_forwards):
            self.offer_alike(host, key, template, passes_objects=passes_objects)
            return
        self.installed.add(key)
        if key not in self.shared.meta_copies:  # before the host changes: other calls are captured from it
            self.shared.meta_copies[key] = meta_template(module)
        bound = self.bind(module, key, template)
        forward = GraphForward(module, bound.analysis.graphs, inputs, compiled=bound.compiled)
        forward.install()
        served, offered, failed = [], [], []
        outcomes = self.shared.checked.get_or_make(key, dict)  # by group layout
        for hg, shared_slots, point in zip(bound.analysis.groups, bound.slots, bound.points):
            group_slots = list(shared_slots)  # the host's own: a capture for another call may add to it
            g = self.make_group(host, hg.spec)
            self.editor.plumbing[g] = GroupPlumbing(host=host, tap_point=point, sink=join_path(host, hg.spec.sink),
                                                    constants=hg.constants, slots=group_slots)
            layout = self.layout_within(host, g)
            if layout not in outcomes:
                outcomes[layout] = self_check(self.editor, g, inputs)
            if self.offer(g, outcomes[layout]):
                offered.append(g)
                served.append((g, GroupRecord(hg.spec.sink, hg.spec.kind, hg.spec.count, hg.spec.min_count,
                                              tuple(hg.spec.members), group_slots, point, hg.sites[0].layout)))
            else:
                del self.editor.plumbing[g]
                failed.append(g)
        offered = self.without_partners_left_out(failed, offered)
        served = [record for g, record in served if any(g is kept for kept in offered)]
        server = forward.server = HostServer(self.shared.meta_copies[key], host, inputs, served,
                                             self.shared.recaptured)
        if passes_objects:  # the own forward is fitted once for hosts built alike
            if key in self.shared.own_forwards:  # the same template, groups and analysed call
                server.fit = self.shared.own_forwards[key]
            server.fit_own_forward()
            self.shared.own_forwards[key] = server.fit
            self.limit_to_own_forward(offered, server.fit)

    def bind(self, module: nn.Module, key: HostKey, template: HostAnalysis) -> BoundGraphs:
        """Set the host's slots, tap points and traced constants as plain attributes (the state_dict keeps its
        keys), over graphs that read them: those of a host built alike if one was bound before, else a copy of
        the template's, rewritten here."""
        fresh = not any(k.startswith((CONSTANT_PREFIX, POINT_PREFIX)) for k in module.__dict__)
        bound = self.shared.bound.get(key) if fresh else None
        if bound is not None:
            module.__dict__.update(bound.analysis.tensors)
            for hg, slots in zip(bound.analysis.groups, bound.slots):
                for slot in slots:
                    module.__dict__[slot.attr] = slot.per_unit * hg.spec.count
            module.__dict__.update({point: TapPoint() for point in bound.points})
            return bound
        found = template.copy()
        module.__dict__.update(found.tensors)
        slots = [bind_constants(module, hg.constants, hg.spec.count) for hg in found.groups]
        bound = BoundGraphs(found, slots, [add_tap_point(module, hg) for hg in found.groups])
        if fresh:  # attributes named as on any host built alike
            self.shared.bound[key] = bound
        return bound

    def offer_alike(self, host: str, key: HostKey, template: HostAnalysis, *, passes_objects: bool) -> None:
        """Offer the groups of a host built alike as one installed before, by that host's self-check outcomes and
        fit of its own forward, without installing it."""
        offered, failed, outcomes = [], [], self.shared.checked[key]
        for hg in template.groups:  # named in turn: a name taken by the group before is not given again
            g = self.make_group(host, hg.spec)
            (offered if self.offer(g, outcomes[self.layout_within(host, g)]) else failed).append(g)
        offered = self.without_partners_left_out(failed, offered)
        if passes_objects:
            self.limit_to_own_forward(offered, self.shared.own_forwards[key])

    @staticmethod
    def layout_within(host: str, g: UnitGroup) -> tuple:
        """What decides a group's self-check outcome beside its host's key (identical code, layout and inputs give
        identical outcomes): its slices, named within the host."""
        return tuple(replace(sl, name=sl.name[len(host):]) for sl in g.slices)

    def offer(self, g: UnitGroup, failure: Reason | None) -> bool:
        """Offer ``g`` if its self-check found nothing wrong, else leave it out with what went wrong."""
        if failure is not None:
            self.findings.leave_out(g.module, [f"self-check failed: {failure.text}"])
            return False
        self.findings.groups.append(g)
        return True

    def without_partners_left_out(self, failed: list[UnitGroup], offered: list[UnitGroup]) -> list[UnitGroup]:
        """The host's groups offered, once those sharing a dim with a group left out (segments of one fused
        projection) are left out too: the segments of a dim tile it, so its size tells their counts."""
        lost = {(sl.name, sl.dim) for g in failed for sl in g.slices}
        kept = list(offered)
        while partners := [g for g in kept if any((sl.name, sl.dim) in lost for sl in g.slices)]:
            for g in partners:
                shared = next(sl.name for sl in g.slices if (sl.name, sl.dim) in lost)
                self.findings.leave_out(g.module, [f"{shared}: shares a dim with a group left out, in segments"])
                self.findings.groups.remove(g)
                self.editor.plumbing.pop(g, None)
                kept.remove(g)
                lost |= {(sl.name, sl.dim) for sl in g.slices}
        return kept

    @staticmethod
    def limit_to_own_forward(groups: list[UnitGroup], fit: OwnForwardFit) -> None:
        """The groups of a host whose own forward serves its calls: a note where it cannot serve them at all, and
        one unit at least where it cannot run a group with none."""
        for g in groups:
            if fit.fault:
                g.notes += (f"calls that pass an object (a key/value cache) are refused: its host's own forward "
                            f"{fit.fault}",)
            elif fit.empty_fault and g.min_count == 0:
                g.min_count = 1
                g.notes += (f"keeps one unit: its host's own forward, which serves the calls that pass an object "
                            f"(a key/value cache), {fit.empty_fault} with none",)

    def make_group(self, host: str, spec: GroupSpec) -> UnitGroup:
        module = join_path(host, common_module(spec.modules))
        base = f"{module or type(self.model).__name__}:{spec.kind}"
        name = base
        for k in itertools.count(1):
            if all(g.name != name for g in self.findings.groups):
                break
            name = f"{base}{k}"
        slices = tuple(replace(m, name=join_path(host, m.name)) for m in spec.members)
        return UnitGroup(name=name, kind=spec.kind, module=module, count=spec.count, max_count=spec.count,
                         exact=spec.exact, slices=slices, notes=tuple(spec.notes), min_count=spec.min_count)


def add_tap_point(module: nn.Module, hg: HostGroup) -> str:
    """Give ``module`` a tap point for the group and route every call of its output projection (and of a map that
    mixes its heads) through it."""
    attr = f"{POINT_PREFIX}{sum(k.startswith(POINT_PREFIX) for k in module.__dict__)}"
    module.__dict__[attr] = TapPoint()
    for site in hg.sites:
        insert_tap_point(attr, site.sink, site.input, site.layout)
    return attr
