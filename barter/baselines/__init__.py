"""Baselines that train dense tensors under masks: unstructured dynamic sparse training (RigL, SET, SNFS, SRigL)
of the weights BARTER compacts, and S²ViTE's structured exploration of heads and FFN channels.

    sp = build_baseline("rigl", model, optimizer, density=0.3, total_steps=T, seed=0)
    ... loss.backward(); optimizer.step(); sp.step()

`METHODS` names them without importing torch; the other names are imported on first use (`barter.lazy`).
"""
from typing import TYPE_CHECKING

from ..lazy import lazy_names
from ..method_names import Family, named

METHODS = named(Family.BASELINE)

if TYPE_CHECKING:
    from .build import build_sparse, sparse_targets, sparse_weight_names
    from .density import erk_densities, layer_counts, layer_densities
    from .dynamic import DynamicSparse
    from .registry import baseline_options, build_baseline
    from .s2vite import StructuredSparse, build_s2vite
    from .scheduled import SparseTraining
    from .snfs import SparseMomentum, build_snfs
    from .srigl import ConstantFanInSparse, build_srigl, condense, condensed_linear
    from .update import cosine_drop_fraction, drop_and_grow

__all__ = ["METHODS", "ConstantFanInSparse", "DynamicSparse", "SparseMomentum", "SparseTraining",
           "StructuredSparse", "baseline_options", "build_baseline", "build_s2vite", "build_snfs", "build_sparse",
           "build_srigl", "condense", "condensed_linear", "cosine_drop_fraction", "drop_and_grow", "erk_densities",
           "layer_counts", "layer_densities", "sparse_targets", "sparse_weight_names"]
__getattr__, __dir__ = lazy_names(__name__, {
    "build_sparse": "build", "sparse_targets": "build", "sparse_weight_names": "build",
    "erk_densities": "density", "layer_counts": "density", "layer_densities": "density",
    "DynamicSparse": "dynamic", "baseline_options": "registry", "build_baseline": "registry",
    "StructuredSparse": "s2vite", "build_s2vite": "s2vite", "SparseTraining": "scheduled",
    "SparseMomentum": "snfs", "build_snfs": "snfs", "ConstantFanInSparse": "srigl", "build_srigl": "srigl",
    "condense": "srigl", "condensed_linear": "srigl", "cosine_drop_fraction": "update", "drop_and_grow": "update",
})
