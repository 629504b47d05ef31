"""Finding the groups of one traced graph: label it, inline the helpers it can look into, group."""
from __future__ import annotations

import contextlib
from typing import Any, NamedTuple

import torch
import torch.fx

from ..capture.calls import buffers_kept, forked_rng, materialize, real_values
from ..capture.inline import inline_helpers
from ..capture.tracer import MODULE_CALLS
from ..compat import tree_map
from ..dataflow.grouping import GraphGroups, group_graph
from ..dataflow.input_gathers import insert_gathers
from ..dataflow.labeller import Labeller
from ..dataflow.repeats import find_repeats
from ..dataflow.rules import RULES
from ..errors import AnalysisError


def node_kind(lab: Labeller, node: torch.fx.Node) -> str:
    """What ``node`` held when ``lab`` ran its graph: "tensor", "none" or "other"."""
    shape = lab.shapes.get(node)
    if shape is not None and all(isinstance(d, int) for d in shape):
        return "tensor"
    return "none" if node in lab.values and lab.values[node] is None else "other"


def find_groups(gm: torch.fx.GraphModule, values: list, where: str, *, returns_units: bool = False) -> GraphGroups:
    """The groups of the graph and the parts it refuses (``returns_units``: see ``dataflow.grouping._Builder``)."""
    return group_graph(_labelled(gm, values, where, locate=False), returns_units=returns_units)


class TracedCall(NamedTuple):
    """A module's first call in a symbolic trace ((args, kwargs) with nodes: ``tracer.MODULE_CALLS``) and the
    labelling of that trace."""

    call: tuple[tuple, dict]
    lab: Labeller

    def values(self) -> tuple[tuple, dict]:
        """The call as (args, kwargs) of meta tensors laid out as the labelling's values were, and plain values (one
        object per node, as a call passes one tensor twice): what a meta run of the model would hand the module.
        LookupError where the labelling holds a node of it as neither (a node inlining replaced, a list)."""
        made: dict[torch.fx.Node, Any] = {}

        def value(x: Any) -> Any:
            if not isinstance(x, torch.fx.Node):
                return x
            if x not in made:
                made[x] = _meta_value(self.lab, x)
            return made[x]

        return tree_map(value, self.call)


def locate_groups(gm: torch.fx.GraphModule, values: list, where: str) -> tuple[GraphGroups, dict[str, TracedCall]]:
    """Only where the candidate groups are (a whole model, whose blocks built alike are labelled once and their
    records replayed: see ``dataflow.repeats``), and each module's first call in the trace: none where the graph
    was labelled for real (data-dependent code), whose calls a run of the model must record with their data."""
    lab = _labelled(gm, values, where, locate=True)
    calls = {path: TracedCall(call, lab) for path, call in gm.meta.get(MODULE_CALLS, {}).items()} if lab.meta else {}
    return group_graph(lab, locate=True), calls


def _labelled(gm: torch.fx.GraphModule, values: list, where: str, locate: bool) -> Labeller:
    """The graph labelled on the meta device (shapes only); data-dependent code runs for real."""
    repeats = find_repeats(gm) if locate else {}
    for meta in (True, False):  # labelling runs for real what reads buffers alone: they are put back after it
        lab = Labeller(gm, RULES, meta=meta, repeats=repeats)
        try:
            with torch.no_grad(), forked_rng([v for v in values if torch.is_tensor(v)]), buffers_kept(gm), \
                    (contextlib.nullcontext() if meta else real_values(gm)):  # a meta module too runs for real
                lab.run(*(values if meta else materialize(values)))
            break
        except Exception as e:
            if not meta:
                raise AnalysisError(f"analysis of {where or 'the model'} failed: {type(e).__name__}: {e}") from e
    if inline_helpers(gm.graph, lambda n: node_kind(lab, n)):  # helpers it could look into are now inline
        gm.recompile()
        return _labelled(gm, values, where, locate)
    if not locate and insert_gathers(gm, lab.rec.gathers):  # a host's inputs lined up with its heads: gathered
        return _labelled(gm, values, where, locate)
    return lab


def _meta_value(lab: Labeller, node: torch.fx.Node) -> Any:
    """A meta tensor as ``node``'s value was laid out, or its plain value; LookupError where the labelling holds
    neither (a node inlining replaced, a value of another kind)."""
    if node_kind(lab, node) == "tensor" and node in lab.strides:
        return torch.empty_strided(lab.shapes[node], lab.strides[node], dtype=lab.dtypes[node], device="meta")
    if node in lab.values and isinstance(lab.values[node], (int, float, bool, type(None))):
        return lab.values[node]
    raise LookupError(node)
