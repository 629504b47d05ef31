"""Serving calls a host was not analysed on: a graph captured for the call, or the host's own forward.

At installation a host keeps a template of itself at its analysed widths (parameters on the meta device, so it
costs no memory; buffers real: index tables matter). A call of a new signature materialises the template with
random weights, records and analyses it with the call's inputs in the call's mode (both front ends, as at
installation), finds every group again by its output projection, binds the new graph's count constants to the
group's slots (so every later edit sets them, as it sets the first graph's) and routes its projections through
the group's tap points. Re-capturing the template rather than rewriting the first graph by hand is what keeps
the guarantee: the new graph is read by the same analysis that proved the first one, so a branch the first
call did not take (a mask, returned attention weights) is analysed, not assumed. Hosts built alike share one
analysis per signature.

A call no graph can take (it passes an object such as a key/value cache, whose own methods a graph would drop;
submodules inside the host carry hooks, which a graph that inlines them would skip), or whose capture does not
find the groups again, is served by the host's own forward where that follows the widths (``own_forward``).
Otherwise the call is refused, naming the host and the arguments that differ from the analysed call.
"""
from __future__ import annotations

import copy
import functools
import math
from contextlib import ExitStack
from typing import Any, NamedTuple

import torch
import torch.nn as nn

from ..analysis.host import HostAnalysis, analyse_host, fingerprint
from ..capture.calls import attributes_read, forked_rng, materialize
from ..capture.tracer import CODE_CONSTANT
from ..compat import tree_leaves, tree_map
from ..dataflow.input_gathers import Gather, argument_gathers
from ..editing import bind_constants
from ..errors import AnalysisError, TraceError, UnservedCall
from ..groups import GroupPlumbing
from ..lru import LruCache
from ..reason import Reason
from ..taps import insert_tap_point
from .call_signature import call_signature, differing_arguments, holds_objects, serves_sizes, without_objects
from .graph_forward import MAX_GRAPHS
from .own_forward import CountAttribute, OwnForward, current_counts, fit_count_attributes


class CallKey(NamedTuple):
    """What the analysis of a call of a new signature depends on: the host template's modules
    (``HostKey.modules``) and the call's signature (``call_signature``); an analysis held for it serves a call
    only where the call has the input sizes its graph fixes (``serves_sizes``)."""

    template: tuple
    signature: tuple


class OwnForwardFit(NamedTuple):
    """Whether a host's own forward follows the widths: what goes wrong in it ("" if nothing), the attributes it
    reads that follow the counts, what goes wrong in it once a group has no units (holding one zero unit), and the
    module inputs it reads through the units' index buffers, as the graphs do (``dataflow.input_gathers``)."""

    fault: str
    counts: list[CountAttribute]
    empty_fault: str
    gathers: list[Gather]


class HostServer:
    """Serves one host's calls of new signatures (see the module docstring)."""

    def __init__(self, template: nn.Module, host: str, analysed: tuple[tuple, dict], groups: list[GroupPlumbing],
                 shared: LruCache[CallKey, HostAnalysis | Reason], *, graph: torch.fx.Graph):
        self.template = template
        self.graph = graph  # an analysed graph: where it reads module inputs through the units' index buffers
        self.host = host
        self.analysed = analysed
        self.groups = groups
        self.shared = shared
        self.fit: OwnForwardFit | None = None  # fitted on the analysed call, or a host alike's
        # by the signature of each call its own forward serves, at most as many as the graphs a host keeps
        self.fits: LruCache[tuple, OwnForwardFit] = LruCache(MAX_GRAPHS)
        self.state_forwards: LruCache[tuple, OwnForward] = LruCache(MAX_GRAPHS)  # by signature, see state_forward
        self.analysed_reads: set[tuple[str, str]] | None = None  # the attributes the analysed call reads

    def serve(self, module: nn.Module, args: tuple, kwargs: dict, training: bool,
              hooked: tuple[str, ...]) -> tuple[torch.fx.Graph | None, str]:
        """A graph captured for this call, or None (and why) where the host's own forward serves it."""
        key = call_signature(args, kwargs, training, hooked)
        if hooked:
            return self.own(module, (args, kwargs), key, f"hooks on {', '.join(hooked)}, whose calls a graph inlines")
        if holds_objects((args, kwargs)):
            return self.own(module, (args, kwargs), key, "the call passes an object a graph cannot take")
        try:
            return self.capture(module, args, kwargs, training), "captured for this call"
        except (TraceError, AnalysisError, UnservedCall) as err:
            return self.own(module, (args, kwargs), key, str(err).splitlines()[0])

    def capture(self, module: nn.Module, args: tuple, kwargs: dict, training: bool) -> torch.fx.Graph:
        """A graph of the template for this call in mode ``training``, bound to ``module``'s slots and tap points."""
        real = self.materialize(module)
        inputs = tree_map(lambda t: t.detach() if torch.is_tensor(t) else t, materialize((args, kwargs)))
        differing = self.differing_reads(module, real, inputs)
        if differing:  # the template is a host built alike, not this one: a graph of it would hold its values
            raise UnservedCall(f"the call reads {', '.join(differing)}, which the analysed call does not read and "
                               f"in which hosts built alike differ")
        key = CallKey(fingerprint(real, (), {}).modules, call_signature(args, kwargs, training))
        held = self.shared.get(key)
        if held is None or isinstance(held, HostAnalysis) and not serves_sizes(held.graphs[training], *inputs):
            try:
                with _no_autocast(), torch.no_grad(), forked_rng(tree_leaves(inputs)):
                    self.shared[key] = analyse_host(real, self.host, *inputs, modes=(training,), returns_units=True)
            except (TraceError, AnalysisError) as err:
                self.shared[key] = Reason(str(err), module=self.host)
        analysis = self.shared[key]
        if isinstance(analysis, Reason):
            raise TraceError(analysis.text)
        found = analysis.copy()
        by_sink = {(hg.spec.sink, hg.spec.kind): hg for hg in found.groups if hg.spec.count}
        lost = [r.sink for r in self.groups if by_sink.get((r.sink, r.kind)) is None
                or by_sink[(r.sink, r.kind)].spec.count != r.max_count]
        if lost:
            why = "; ".join(reason for refusal in found.refusals for reason in refusal.reasons) or "not found"
            raise UnservedCall(f"the units read by {', '.join(lost)} are no group in this call's graph ({why})")
        counts = current_counts(module, self.groups)
        for r, count in zip(self.groups, counts):
            hg = by_sink[(r.sink, r.kind)]
            bind_constants(module, hg.constants, count, r.slots)
            for site in hg.sites:
                insert_tap_point(r.tap_point, site.sink, site.input, site.layout)
        graph = found.graphs[training]
        _attach_code_constants(module, graph, found.tensors)
        return graph

    def differing_reads(self, module: nn.Module, real: nn.Module, inputs: tuple[tuple, dict]) -> list[str]:
        """The plain attributes this call reads and the analysed call does not (hosts built alike may differ in
        them: a block's index) whose values differ between ``module`` and its template ``real``."""
        if self.analysed_reads is None:
            self.analysed_reads = attributes_read(self.template, *self.analysed) or set()
        if not self.analysed_reads:  # every attribute was in the host's fingerprint: its template's are its own
            return []
        reads = attributes_read(real, *inputs)
        if reads is None:  # not known: every attribute may be read
            reads = {(path, name) for path, m in real.named_modules() for name in vars(m)}
        missing = object()
        differing = []
        for path, name in sorted(reads - self.analysed_reads):
            own, live = vars(real.get_submodule(path)).get(name, missing), vars(module.get_submodule(path)).get(name)
            if not name.startswith("_") and own is not missing and not isinstance(own, (torch.Tensor, nn.Module)) \
                    and repr(own) != repr(live):
                differing.append(f"{path}.{name}" if path else name)
        return differing

    def fit_own_forward(self) -> None:
        """Fit the host's own forward on the analysed call, once (``self.fit``: what goes wrong in it, "" if
        nothing)."""
        if self.fit is None:
            self.fit = self._fitted(None)

    def fit_call(self, key: tuple, call: tuple[tuple, dict]) -> OwnForwardFit:
        """The own forward's fit for a call it serves (of signature ``key``), checked on that call too: a path the
        analysed call did not take may read a count it stores (a key/value head repeated to the query heads only
        where a mask is passed). The call runs on copies of the template with its objects left out (a cache
        holds values at the current widths, not the template's); one the template cannot run so is not checked."""
        if key not in self.fits:
            self.fit_own_forward()
            self.fits[key] = self.fit if self.fit.fault else self._fitted(call)
        return self.fits[key]

    @torch.compiler.disable  # an analysis, run once per kind of call: a compiled call that meets it runs it eagerly
    def _fitted(self, call: tuple[tuple, dict] | None) -> OwnForwardFit:
        """The fit on the analysed call, and on ``call`` too where one is given (after the analysed call's own)."""
        if call is None:
            gathers = argument_gathers(self.materialize(None), self.graph, materialize(self.analysed))
            if isinstance(gathers, Reason):
                return OwnForwardFit(gathers.text, [], "", [])
            calls = [self.analysed]
        else:
            gathers = self.fit.gathers
            calls = [self.analysed, tree_map(lambda t: t.detach().cpu() if torch.is_tensor(t) else t,
                                             without_objects(call))]
        copies = functools.partial(self.materialize, None)
        counts, fault, empty_fault = fit_count_attributes(copies, self.groups, calls, gathers=gathers)
        return OwnForwardFit(fault, counts or [], empty_fault, gathers)

    def own(self, module: nn.Module, call: tuple[tuple, dict], key: tuple, why: str) -> tuple[None, str]:
        """The host's own forward, if it follows the widths (``own_forward``); else the call is refused."""
        fault = self.fit_call(key, call).fault
        if fault:
            own = type(module).forward.__get__(module)
            differs = ", ".join(differing_arguments(own, call, self.analysed)) or "the analysed arguments"
            raise UnservedCall(f"{self.host or 'the model'} ({type(module).__name__}) cannot serve a call with "
                               f"{differs}: {why}; and its own forward {fault}")
        return None, f"its own forward ({why})"

    def own_forward(self, key: tuple) -> OwnForward:
        """The host's own forward for calls of signature ``key``, its count attributes kept in step (as fitted on
        such a call) and its taps run."""
        fit = self.fits.get(key) or self.fit
        if fit is None:
            self.fit_own_forward()
            fit = self.fit
        return OwnForward(self.groups, fit.counts, self.template, gathers=fit.gathers)

    def state_forward(self, module: nn.Module, key: tuple, call: tuple[tuple, dict]) -> OwnForward | None:
        """For a call whose graph returns state (a key/value cache) while a group of the host has no units: the
        own forward, which stores one zero unit for that group as it does for the calls that pass the state back
        (a graph would store an empty tensor, which a cache takes for no entries); None where no group is empty or
        the own forward cannot serve it (the calls passing the state back are then refused)."""
        if not self.has_empty_group(module) or self.fit_call(key, call).fault:
            return None
        own = self.state_forwards.get_or_make(key, lambda: self.own_forward(key))
        return None if own.refusal(module) else own

    def has_empty_group(self, module: nn.Module) -> bool:
        """Whether a group of the host has no units now: read off a count slot of the group (each edit sets it),
        one lookup per group and call; off the tensors' sizes only where a group that may be emptied has none."""
        if any(r.slots and module.__dict__[r.slots[0].attr] == 0 for r in self.groups):
            return True
        return any(not r.slots and r.min_count == 0 for r in self.groups) and not all(current_counts(module,
                                                                                                   self.groups))

    def materialize(self, like: nn.Module | None, *, unit_scale: bool = False) -> nn.Module:
        """A real copy of the template, its parameters random (on ``like``'s devices and dtypes, if given): small
        (std 0.02), or with ``unit_scale`` at the scale that keeps values of order one through the host (a matrix's
        std 1/sqrt(fan-in), a vector's 1), where attention is far from uniform and each head's share shows."""
        real = copy.deepcopy(self.template)
        live = dict(like.named_parameters()) if like is not None else {}
        live_buffers = dict(like.named_buffers()) if like is not None else {}
        gen = torch.Generator().manual_seed(0)
        names = {id(p): name for name, p in real.named_parameters()}
        made: dict[int, nn.Parameter] = {}  # tied parameters stay tied
        for owner in real.modules():
            for pname, p in list(owner.named_parameters(recurse=False, remove_duplicate=False)):
                if id(p) not in made:
                    ref = live.get(names[id(p)])
                    value = torch.randn(p.shape, generator=gen).mul_(_draw_std(p.shape, unit_scale))
                    made[id(p)] = nn.Parameter(value.to(dtype=p.dtype if ref is None else ref.dtype,
                                                        device="cpu" if ref is None else ref.device),
                                               requires_grad=p.requires_grad)
                setattr(owner, pname, made[id(p)])
        for name, b in real.named_buffers():
            ref = live_buffers.get(name)
            if ref is not None:
                b.data = b.data.to(device=ref.device, dtype=ref.dtype if b.is_floating_point() else b.dtype)
        return real


def _draw_std(shape: torch.Size, unit_scale: bool) -> float:
    if not unit_scale:
        return 0.02
    fan_in = math.prod(shape[1:])
    return 1.0 if len(shape) < 2 or not fan_in else fan_in ** -0.5


def meta_template(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose parameters are on the meta device (no memory); buffers are copied."""
    memo: dict[int, Any] = {id(p): nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
                            for p in module.parameters()}
    return copy.deepcopy(module, memo)


def _attach_code_constants(module: nn.Module, graph: torch.fx.Graph, tensors: dict[str, torch.Tensor]) -> None:
    """Tensors the capture made from the code become attributes of the live host under fresh names."""
    renamed: dict[str, str] = {}
    for node in graph.nodes:
        if node.op == "get_attr" and node.target in tensors:
            if node.target not in renamed:
                k = sum(name.startswith(CODE_CONSTANT) for name in module.__dict__)
                while f"{CODE_CONSTANT}{k}" in module.__dict__:
                    k += 1
                renamed[node.target] = f"{CODE_CONSTANT}{k}"
                module.__dict__[renamed[node.target]] = tensors[node.target]
            node.target = renamed[node.target]


def _no_autocast() -> ExitStack:
    """A capture in the middle of a mixed-precision forward records the module's own dtypes, not autocast's."""
    stack = ExitStack()
    for device in ("cpu", "cuda"):
        if device == "cpu" or torch.cuda.is_available():
            stack.enter_context(torch.autocast(device, enabled=False))
    return stack
