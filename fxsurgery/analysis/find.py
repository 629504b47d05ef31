"""Finding the groups of one traced graph: label it, inline the helpers it can look into, group."""
from __future__ import annotations

import torch
import torch.fx

from ..capture.calls import buffers_kept, forked_rng, materialize
from ..capture.inline import inline_helpers
from ..dataflow.grouping import GraphGroups, analyse
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


def find_groups(gm: torch.fx.GraphModule, values: list, where: str, locate: bool = False) -> GraphGroups:
    """Label the graph on the meta device (shapes only); data-dependent code runs for real. With
    ``locate``, only where the candidate groups are (a whole model, whose blocks built alike are labelled once and
    their records replayed: see ``dataflow.repeats``)."""
    repeats = find_repeats(gm) if locate else {}
    for meta in (True, False):  # labelling runs for real what reads buffers alone: they are put back after it
        lab = Labeller(gm, RULES, meta=meta, repeats=repeats)
        try:
            with torch.no_grad(), forked_rng([v for v in values if torch.is_tensor(v)]), buffers_kept(gm):
                lab.run(*(values if meta else materialize(values)))
            break
        except Exception as e:
            if not meta:
                raise AnalysisError(f"analysis of {where or 'the model'} failed: {type(e).__name__}: {e}") from e
    if inline_helpers(gm.graph, lambda n: node_kind(lab, n)):  # helpers it could look into are now inline
        gm.recompile()
        return find_groups(gm, values, where, locate)
    return analyse(lab, locate)
