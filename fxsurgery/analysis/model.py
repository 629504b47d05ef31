"""Analysing a whole model: trace its regions, locate the hosts, install each host's rewritten graphs,
and offer every group that passes the self-check."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch.nn as nn

from ..capture.call_signature import holds_objects, without_objects
from ..capture.calls import capture_inputs
from ..capture.front_ends import SYMBOLIC
from ..capture.graph_forward import GraphForward
from ..dataflow.grouping import GroupSpec
from ..dataflow.paths import common_module
from ..editing import Editor, bind_constants
from ..errors import AnalysisError, TraceError
from ..groups import GroupPlumbing, LeftOut, UnitGroup
from ..slicing import ParamSlice
from ..taps import POINT_PREFIX, TapPoint, insert_tap_point
from .host import HostAnalysis, HostGroup, analyse_host, fingerprint
from .own_forward import GroupRecord
from .recapture import Analyses, HostServer, OwnForwardFit, meta_template
from .regions import TraceFailure, find_regions, join_path, locate_hosts
from .verify import self_check


@dataclass
class Findings:
    """The groups offered and the parts left out, in the order found."""

    groups: list[UnitGroup] = field(default_factory=list)
    left_out: list[LeftOut] = field(default_factory=list)
    front_ends: dict[str, str] = field(default_factory=dict)  # host module -> the front end that recorded it

    def leave_out(self, module: str, reasons: list[str]) -> None:
        """Report ``module`` as left out (once: a region and its host may find the same refusal)."""
        if LeftOut(module, reasons) not in self.left_out:
            self.left_out.append(LeftOut(module, reasons))


@dataclass
class SharedAnalyses:
    """What hosts built alike share, keyed by their fingerprint: one analysis, one self-check outcome per group
    layout, one fit of the own forward, and the captures for other calls. Installing the same plan on another
    model built alike (the analysed copy's original) reuses all of it."""

    templates: dict[tuple, HostAnalysis | str] = field(default_factory=dict)  # an analysis, or why it failed
    checked: dict[tuple, str | None] = field(default_factory=dict)
    own_forwards: dict[tuple, OwnForwardFit] = field(default_factory=dict)
    recaptured: Analyses = field(default_factory=dict)


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
    shared: SharedAnalyses


def _inside(name: str, outer: str) -> bool:
    """Module ``name`` lies strictly inside module ``outer`` ("" is the model)."""
    return name != outer and (not outer or name.startswith(outer + "."))


def plan_model(model: nn.Module, example: tuple[tuple, dict]) -> ModelPlan:
    """Trace ``model`` called as ``example`` (args, kwargs), locate the hosts and analyse each kind of host."""
    found = Findings()
    regions, failures = find_regions(model, example, found.leave_out)
    hosts = locate_hosts(model, regions, found.leave_out)
    plan = ModelPlan([], {}, {}, found.left_out, failures, SharedAnalyses())
    if hosts:
        calls = capture_inputs(model, example, [n for n, _ in model.named_modules() if n])
        calls[""] = example
        # an object argument (a key/value cache) is no graph input: the analysis reads the call without it
        plan.calls = {name: without_objects(call) for name, call in calls.items()}
        plan.hosts = _callers_of_returned_heads(model, hosts, plan)
        plan.passes_objects = {host: holds_objects(calls[host]) for host in plan.hosts}
    return plan


def install_model(model: nn.Module, plan: ModelPlan, editor: Editor) -> Findings:
    """Install the plan's hosts on ``model`` (the model planned, or one built alike) and offer every group that
    passes the self-check; their plumbing goes to ``editor``."""
    findings = Findings(left_out=list(plan.left_out))
    installer = _Installer(model, editor, findings, plan.shared)
    for host in plan.hosts:
        # a host inside a module kept whole by the symbolic trace is seen by an outer host captured otherwise
        if any(_inside(host, outer) and front_end != SYMBOLIC for outer, front_end in findings.front_ends.items()):
            continue
        installer.install(host, plan.calls[host], passes_objects=plan.passes_objects[host])
    # modules that did not trace: their parts were analysed on their own where they traced
    for name, err in plan.failures:
        findings.leave_out(name, [str(err)])
    if not findings.groups:
        if plan.failures:
            raise TraceError("; ".join(str(err) for _, err in plan.failures))
        why = "; ".join(f"{lo.module}: {', '.join(lo.reasons)}" for lo in findings.left_out) \
            or "no attention heads or FFN channels"
        raise AnalysisError(f"no unit groups found in {type(model).__name__}: {why}")
    return findings


def _callers_of_returned_heads(model: nn.Module, hosts: list[str], plan: ModelPlan) -> list[str]:
    """The hosts, each one whose heads reach its outputs (an attention module that returns its per-head
    attention weights) replaced by its nearest calling module, where the weights may be dropped."""
    inputs = plan.calls
    hosts = list(hosts)
    for host in list(hosts):
        found = host_analysis(model, host, inputs[host], plan.shared)
        if host not in hosts or isinstance(found, str) or found.groups or not found.refusals \
                or not all(r.at_output for r in found.refusals):
            continue
        caller = host
        while caller:
            caller = caller.rpartition(".")[0]
            if caller in inputs:  # containers such as ModuleList are never called themselves
                break
        hosts = [h for h in hosts if not (h == caller or h.startswith(caller + ".") or not caller)] + [caller]
    return hosts


def host_analysis(model: nn.Module, host: str, inputs: tuple[tuple, dict], shared: SharedAnalyses
                  ) -> HostAnalysis | str:
    """The host's analysis (hosts built alike, every block of a ViT, are analysed once), or why it failed."""
    module = model.get_submodule(host) if host else model
    key = fingerprint(module, *inputs)
    if key not in shared.templates:
        try:
            shared.templates[key] = analyse_host(module, host, *inputs)
        except (TraceError, AnalysisError) as err:  # this host is left out; the others go on
            shared.templates[key] = str(err)
    return shared.templates[key]


class _Installer:
    """Installs hosts one by one; hosts built alike share one analysis and one self-check outcome."""

    def __init__(self, model: nn.Module, editor: Editor, findings: Findings, shared: SharedAnalyses):
        self.model, self.editor, self.findings, self.shared = model, editor, findings, shared

    def install(self, host: str, inputs: tuple[tuple, dict], *, passes_objects: bool) -> None:
        """Install the host's graphs and offer its groups that pass the self-check. A host whose calls pass an
        object is served by its own forward: where that cannot run a group with no units, the group keeps one."""
        module = self.model.get_submodule(host) if host else self.model
        key = fingerprint(module, *inputs)
        template = host_analysis(self.model, host, inputs, self.shared)
        if isinstance(template, str):
            self.findings.leave_out(host, [template])
            return
        found = template.copy()
        self.findings.front_ends[host] = found.front_end
        for r in found.refusals:
            self.findings.leave_out(join_path(host, common_module(r.modules)), r.reasons)
        analysed_copy = meta_template(module)  # before the host changes: other calls are captured from it
        module.__dict__.update(found.tensors)  # plain attributes: the state_dict keeps its keys
        slots = [bind_constants(module, hg.constants, hg.spec.count) for hg in found.groups]
        points = [add_tap_point(module, hg) for hg in found.groups]
        forward = GraphForward(module, found.graphs, inputs)
        forward.install()
        served = []
        for hg, group_slots, point in zip(found.groups, slots, points):
            g = self.make_group(host, hg.spec)
            self.editor.plumbing[g] = GroupPlumbing(host=host, tap_point=point, sink=join_path(host, hg.spec.sink),
                                                    constants=hg.constants, slots=group_slots)
            # identical code, layout and inputs give identical self-check outcomes
            check = (key, tuple((sl.name[len(host):], sl.dim, sl.outer, sl.inner, sl.output) for sl in g.slices))
            if check not in self.shared.checked:
                self.shared.checked[check] = self_check(self.editor, g, inputs)
            if self.shared.checked[check]:
                self.findings.leave_out(g.module, [f"self-check failed: {self.shared.checked[check]}"])
                del self.editor.plumbing[g]
            else:
                self.findings.groups.append(g)
                served.append(GroupRecord(hg.spec.sink, hg.spec.kind, hg.spec.count, hg.spec.min_count,
                                          tuple(hg.spec.members), group_slots, point, hg.sites[0].layout))
        forward.server = HostServer(analysed_copy, host, inputs, served, self.shared.recaptured)
        if passes_objects:
            self.limit_to_own_forward(forward.server, key)

    def limit_to_own_forward(self, server: HostServer, key: tuple) -> None:
        """The groups of a host whose own forward serves its calls: a note where it cannot serve them at all, and
        one unit at least where it cannot run a group with none (fitted once for hosts built alike)."""
        if key in self.shared.own_forwards:
            server.adopt_fit(self.shared.own_forwards[key])
        fault, empty = server.fit_own_forward()
        self.shared.own_forwards[key] = server.fit
        for g in self.findings.groups:
            if self.editor.plumbing[g].host != server.host:
                continue
            if fault:
                g.notes += (f"calls that pass an object (a key/value cache) are refused: its host's own forward "
                            f"{fault}",)
            elif empty and g.min_count == 0:
                g.min_count = 1
                g.notes += (f"keeps one unit: its host's own forward, which serves the calls that pass an object "
                            f"(a key/value cache), {empty} with none",)

    def make_group(self, host: str, spec: GroupSpec) -> UnitGroup:
        module = join_path(host, common_module(spec.modules))
        base = f"{module or type(self.model).__name__}:{spec.kind}"
        name = base
        for k in itertools.count(1):
            if all(g.name != name for g in self.findings.groups):
                break
            name = f"{base}{k}"
        slices = tuple(ParamSlice(join_path(host, m.name), m.dim, m.outer, m.inner, m.output) for m in spec.members)
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
