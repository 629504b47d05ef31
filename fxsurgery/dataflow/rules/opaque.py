"""Ops without a rule: plain Python functions are looked into; anything else pins the ids it receives."""
from __future__ import annotations

import inspect
import os
from typing import Any

import torch

from ...capture.inline import pack
from ...capture.tracer import trace_function
from ...compat import pytree_info, tree_unflatten
from ...errors import TraceError
from ..labeller import Label, Labeller, Step
from ..records import Opaque
from ..rule_table import FALLBACK
from .base import RULES, pin_all, register_rule


@register_rule(pack)
def packed(s: Step) -> Any:
    """An inlined helper's returned structure: the labels of its parts."""
    lab = s.largs[0]
    return tuple(lab) if isinstance(lab, list) else lab


_INLINING: set[Any] = set()  # the functions whose inside is being labelled now (outermost first)


def inline(s: Step) -> Any:
    """A Python function kept opaque in the graph (an autowrapped helper): label its inside."""
    target = s.node.target
    if target in _INLINING:  # its traced inside calls it again (still wrapped): no inside to look at
        raise TraceError(f"{s.name}: {getattr(target, '__name__', target)} traces to a call of itself")
    sig = inspect.signature(target)
    bound = sig.bind(*s.args, **s.kwargs)
    bound.apply_defaults()  # an omitted ``x=None`` is frozen at None, not traced as a tensor
    values = bound.arguments
    labels = sig.bind(*s.largs, **s.lkwargs).arguments
    gm, inputs = trace_function(target, values)
    seeds = {name: labels.get(name) for name, v in values.items() if torch.is_tensor(v)}
    sub = Labeller(gm, RULES, s.rec, seeds)
    _INLINING.add(target)
    try:
        sub.run(*inputs)
    finally:
        _INLINING.discard(target)
    out = sub.labels[next(n for n in gm.graph.nodes if n.op == "output")]
    info = pytree_info(gm.graph)
    return tree_unflatten(list(out), info.out_spec) if info is not None else out


@register_rule(FALLBACK)
def fallback(s: Step) -> None:
    """No rule: look inside plain Python functions; otherwise ids that reach this op become
    unsliceable, unless the op returns no tensor."""
    why = "no rule"
    if s.node.op == "call_function" and inspect.isfunction(s.node.target):
        try:
            return inline(s)
        except TraceError as e:
            why = str(e)
    if torch.is_tensor(s.out) or (isinstance(s.out, (tuple, list)) and any(torch.is_tensor(o) for o in s.out)):
        what = s.node.target if s.node.op != "call_module" else type(s.lab.module.get_submodule(s.node.target)).__name__
        name = getattr(what, "__name__", what)
        pin_all(s, f"no rule for {name}")
        params = [a.target for a in s.node.all_input_nodes if a.op == "get_attr" and _is_param(s.lab.labels.get(a))]
        if params and not s.lab.nested:  # whatever units it holds are invisible: say so
            shared = os.path.commonprefix([p.rpartition(".")[0] + "." for p in params]).rpartition(".")[0]
            shown = ", ".join(p[len(shared) + 1:] if shared else p for p in params)
            s.rec.opaque.append(Opaque(s.node, f"{s.name}: {name} takes parameters ({shown}) and cannot be looked into "
                                         f"({why}): any units inside it are not analysed"))
    return None


def _is_param(label: Any) -> bool:
    return isinstance(label, Label) and label.param
