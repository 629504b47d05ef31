"""Baselines that train dense tensors under masks: unstructured dynamic sparse training (RigL, SET, SNFS, SRigL)
of the weights BARTER compacts, and S²ViTE's structured exploration of heads and FFN channels.

    sp = build_baseline("rigl", model, optimizer, density=0.3, total_steps=T, seed=0)
    ... loss.backward(); optimizer.step(); sp.step()
"""
from .build import build_sparse, sparse_targets, sparse_weight_names
from .density import erk_densities, layer_counts, layer_densities
from .dynamic import DynamicSparse
from .registry import METHODS, baseline_options, build_baseline
from .s2vite import StructuredSparse, build_s2vite
from .scheduled import SparseTraining
from .snfs import SparseMomentum, build_snfs
from .srigl import ConstantFanInSparse, build_srigl, condense, condensed_linear
from .update import cosine_drop_fraction, drop_and_grow

__all__ = ["METHODS", "ConstantFanInSparse", "DynamicSparse", "SparseMomentum", "SparseTraining",
           "StructuredSparse", "baseline_options", "build_baseline", "build_s2vite", "build_snfs", "build_sparse",
           "build_srigl", "condense", "condensed_linear", "cosine_drop_fraction", "drop_and_grow", "erk_densities",
           "layer_counts", "layer_densities", "sparse_targets", "sparse_weight_names"]
