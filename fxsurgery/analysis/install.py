"""Installing a plan's hosts: their rewritten graphs as their forward, each group's slots and tap point, and the
server of their calls of new signatures. ``check_hosts`` installs the first host of each kind on the analysis's
working copy, to self-check its groups there; ``install_model`` installs every host once, on the model a Surgeon
operates on, by the checks and the groups the plan describes."""
from __future__ import annotations

import torch.nn as nn

from ..capture.front_ends import FrontEnd
from ..dataflow.input_gathers import add_index_buffers
from ..dataflow.paths import within
from ..editing import CONSTANT_PREFIX, Editor, bind_constants
from ..groups import GroupPlumbing, UnitGroup
from ..reason import Reason
from ..runtime.graph_forward import GraphForward
from ..runtime.outside_calls import guard_outside_calls
from ..runtime.recapture import HostServer, OwnForwardFit, meta_template
from ..taps import POINT_PREFIX, TapPoint, insert_tap_point
from .cache import AnalysisCache, BoundGraphs
from .host import HostAnalysis, HostGroup, HostKey
from .model import (
    HostCheck,
    ModelPlan,
    group_description,
    group_module,
    group_slices,
    host_analysis,
    layout_within,
    offered,
)
from .verify import self_check


def check_hosts(model: nn.Module, plan: ModelPlan) -> dict[str, HostCheck]:
    """Each host's check, in order, found on ``model``, the analysis's working copy: the first host of each kind is
    installed there and each of its group layouts self-checked (and, where its calls pass objects, its own forward
    fitted); hosts built alike share those outcomes and are not installed. A host inside one that another front end
    than the symbolic trace captured is served by that one: it has no check."""
    editor, checks = Editor(model), {}
    outcomes: dict[HostKey, dict[tuple, Reason | None]] = {}
    fits: dict[HostKey, OwnForwardFit] = {}
    for host in plan.hosts:
        if any(host != outer and within(host, outer) and not isinstance(c.found, Reason)
               and c.found.front_end.front_end is not FrontEnd.SYMBOLIC for outer, c in checks.items()):
            continue
        module = model.get_submodule(host) if host else model
        inputs, passes_objects = plan.calls[host], plan.passes_objects[host]
        key = plan.shared.key_of(module, host, inputs)
        found = host_analysis(model, host, inputs, plan.shared)
        if not isinstance(found, Reason) and (key not in outcomes or (passes_objects and key not in fits)):
            check = HostCheck(key, found, outcomes.setdefault(key, {}), fits.get(key))
            server = _install_and_check(module, host, check, editor=editor, plan=plan)
            if passes_objects:  # the own forward is fitted once for hosts built alike
                server.fit_own_forward()
                fits[key] = server.fit
        checks[host] = HostCheck(key, found, outcomes.get(key, {}), fits.get(key) if passes_objects else None)
    return checks


def _install_and_check(module: nn.Module, host: str, check: HostCheck, *, editor: Editor,
                       plan: ModelPlan) -> HostServer:
    """Install the host with all its groups, self-check each group layout not checked yet (into ``check.outcomes``),
    and keep the plumbing (the editor's, which the server serves by) of the groups offered only. Returns the host's
    server, fitted by ``check.fit`` if given."""
    specs = [hg.spec for hg in check.found.groups]
    trial = [(index, UnitGroup(group_description(host, spec, group_slices(host, spec), fit=None,
                                                 name=f"{group_module(host, spec) or plan.model_name}:{spec.kind}")))
             for index, spec in enumerate(specs)]
    inputs = plan.calls[host]
    server = install_host(module, host, check, inputs=inputs, editor=editor, shared=plan.shared, groups=trial)
    for _, g in trial:
        layout = layout_within(host, g.slices)
        if layout not in check.outcomes:
            check.outcomes[layout] = self_check(editor, g, inputs)
        if check.outcomes[layout] is not None:
            del editor.plumbing[g]
    kept = offered(host, check, plan.aliases).kept
    for index, g in trial:
        if index not in kept:
            editor.plumbing.pop(g, None)
    server.groups[:] = [record for (index, _), record in zip(trial, server.groups) if index in kept]
    server.fit = check.fit
    return server


def install_model(model: nn.Module, plan: ModelPlan, groups: list[UnitGroup], editor: Editor) -> None:
    """Install every checked host of the plan on ``model`` (the model analysed, or one whose hosts have the same
    fingerprints: ``installs_on``), with ``groups``, the Surgeon's views of the groups the plan offers
    (``read_findings``), each placed in its host as ``plan.placed`` says; their plumbing goes to ``editor``."""
    by_name = {g.name: g for g in groups}
    for host, check in plan.checks.items():
        if isinstance(check.found, Reason):
            continue
        module = model.get_submodule(host) if host else model
        placed = [(index, by_name[name]) for index, name in plan.placed[host]]
        server = install_host(module, host, check, inputs=plan.calls[host], editor=editor, shared=plan.shared,
                              groups=placed)
        server.fit = check.fit


def installs_on(model: nn.Module, plan: ModelPlan) -> bool:
    """Whether the plan's checks are of ``model``'s hosts: each has the fingerprint of the host checked."""
    return all(plan.shared.key_of(model.get_submodule(host) if host else model, host, plan.calls[host]) == check.key
               for host, check in plan.checks.items())


def install_host(module: nn.Module, host: str, check: HostCheck, *, inputs: tuple[tuple, dict], editor: Editor,
                 shared: AnalysisCache, groups: list[tuple[int, UnitGroup]]) -> HostServer:
    """Install the host's graphs as its forward, give ``groups`` (each with its index in the host's analysis) their
    plumbing in ``editor``, and return the server of the host's other calls, which serves those groups."""
    held = {sl.name for index, _ in groups for sl in check.found.groups[index].spec.members}
    add_index_buffers(module, list(check.found.graphs.values()), held)  # its units as analysed, in the template too
    if check.key not in shared.meta_copies:  # before the host changes: other calls are captured from it
        shared.meta_copies[check.key] = meta_template(module)
    bound = bind(module, check.key, check.found, shared)
    forward = GraphForward(module, bound.analysis.graphs, inputs, compiled=bound.compiled)
    forward.install()
    records = []
    for index, g in groups:
        hg = bound.analysis.groups[index]
        editor.plumbing[g] = GroupPlumbing(
            host=host, sink=hg.spec.sink, kind=hg.spec.kind, max_count=hg.spec.count, min_count=hg.spec.min_count,
            exact=hg.spec.exact, slices=tuple(hg.spec.members), constants=hg.constants,
            slots=list(bound.slots[index]),  # the host's own: a capture for another call may add to it
            tap_point=bound.points[index], tap_layout=hg.sites[0].layout)
        records.append(editor.plumbing[g])
    forward.server = HostServer(shared.meta_copies[check.key], host, inputs, records, shared.recaptured,
                                graph=next(iter(bound.analysis.graphs.values())))
    guard_outside_calls(module, host, bound.analysis.graphs.values())
    return forward.server


def bind(module: nn.Module, key: HostKey, template: HostAnalysis, shared: AnalysisCache) -> BoundGraphs:
    """Set the host's slots, tap points and traced constants as plain attributes (the state_dict keeps its keys),
    over graphs that read them: those of a host built alike if one was bound before, else a copy of the template's,
    rewritten here."""
    fresh = not any(k.startswith((CONSTANT_PREFIX, POINT_PREFIX)) for k in module.__dict__)
    bound = shared.bound.get(key) if fresh else None
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
        shared.bound[key] = bound
    return bound


def add_tap_point(module: nn.Module, hg: HostGroup) -> str:
    """Give ``module`` a tap point for the group and route every call of its output projection (and of a map that
    mixes its heads) through it."""
    attr = f"{POINT_PREFIX}{sum(k.startswith(POINT_PREFIX) for k in module.__dict__)}"
    module.__dict__[attr] = TapPoint()
    for site in hg.sites:
        insert_tap_point(attr, site.sink, site.input, site.layout)
    return attr
