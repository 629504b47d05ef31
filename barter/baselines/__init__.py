"""Baselines that train dense tensors under masks: unstructured dynamic sparse training (RigL, SET) on the
weights BARTER compacts.

    sp = build_sparse(model, optimizer, method="rigl", density=0.3, total_steps=T, seed=0)
    ... loss.backward(); optimizer.step(); sp.step()
"""
from .build import build_sparse, sparse_weight_names
from .density import erk_densities, layer_counts, layer_densities
from .dynamic import METHODS, DynamicSparse
from .update import cosine_drop_fraction, drop_and_grow

__all__ = ["METHODS", "DynamicSparse", "build_sparse", "cosine_drop_fraction", "drop_and_grow", "erk_densities",
           "layer_counts", "layer_densities", "sparse_weight_names"]
