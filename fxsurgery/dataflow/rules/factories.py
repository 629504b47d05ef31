"""Tensors a factory fills with one number (``torch.zeros((1, n_heads, q, k))``, ``x.new_ones(...)``): every slice of
one is the same tensor smaller, so where it lines up with units it follows them by its size, a count constant."""
from __future__ import annotations

import torch

from ..constants import ConstantSpec, Site, shape_paths
from ..labeller import Label, Step
from .base import RULES, register_rule

_FUNCTIONS = (torch.zeros, torch.ones, torch.full)
_METHODS = ("new_zeros", "new_ones", "new_full")


@register_rule(*_FUNCTIONS, *_METHODS, always=True)
def uniform_fill(s: Step) -> Label | None:
    """Fresh ids, one per element, held like a parameter's: elementwise ops tie them to the units they line up with
    (``base.uniform_ties``), so the fill follows those units; integer and boolean fills (indices, masks) stay plain."""
    if not torch.is_tensor(s.out) or not s.out.is_floating_point() or s.out.dim() == 0:
        return None
    ids = s.rec.fresh(tuple(s.out.shape))
    s.rec.uniform.append(ids)
    return Label(ids, True)


@RULES.constants(*_FUNCTIONS, *_METHODS)
def uniform_fill_constants(site: Site) -> list[ConstantSpec]:
    """The fill's size along the unit axis."""
    if site.out_dim is None:
        return []
    node = site.node
    first = 1 if node.op == "call_method" else 0
    if node.target in (torch.full, "new_full"):  # the size is one sequence, before the fill value
        paths = [("kwargs", "size", k) for k in range(len(node.kwargs["size"]))] if "size" in node.kwargs else \
            [("args", first, k) for k in range(len(node.args[first]))]
    else:
        paths = shape_paths(node, first)
    return [site.constant(paths[site.out_dim], site.out_shape[site.out_dim])]
