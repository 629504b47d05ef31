"""What hosts built alike share, found once per analysis and kept with its plan: installing the plan on the model
analysed reuses it, and so do the calls of new signatures an installed host serves. The self-check outcomes are
no cache: they are part of the plan (``model.HostCheck``)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch.nn as nn

from ..groups import ConstantSlot
from ..lru import LruCache
from ..reason import Reason
from ..runtime.recapture import CallKey
from .host import HostAnalysis, HostKey, fingerprint

HOST_KINDS_LIMIT = 1024  # kinds of host kept (a model has one kind per block built alike: a few, or one per layer)
RECAPTURES_LIMIT = 256  # analyses of calls of new signatures kept (one per host kind, signature and mode)


@dataclass
class BoundGraphs:
    """A host's graphs as installed: count constants read from its slots, projections routed through its tap
    points (per group), and their generated code by graph id. Graphs are never changed once installed, so
    hosts built alike, whose attributes get the same names, share them: the slots and points here are those names,
    of which each installed host's ``groups.GroupPlumbing`` takes a copy of its own."""

    analysis: HostAnalysis
    slots: list[list[ConstantSlot]]
    points: list[str]
    compiled: dict[int, Callable[..., Any]] = field(default_factory=dict)


class AnalysisCache:
    """The tables hosts built alike share, each keyed by the host's ``HostKey`` (its fingerprint): its analysis or
    why it failed, a copy of it as analysed with parameters on the meta device (what other calls are captured
    from), and its graphs as bound. The analyses of calls of new signatures are keyed by ``CallKey``, and each
    host's fingerprint is kept by its path with the module and call it was worked out for. Every table keeps its
    ``limit`` most recently used entries; one forgotten is worked out again."""

    def __init__(self, limit: int = HOST_KINDS_LIMIT, recaptures: int = RECAPTURES_LIMIT):
        self.templates: LruCache[HostKey, HostAnalysis | Reason] = LruCache(limit)
        self.meta_copies: LruCache[HostKey, nn.Module] = LruCache(limit)
        self.bound: LruCache[HostKey, BoundGraphs] = LruCache(limit)
        self.recaptured: LruCache[CallKey, HostAnalysis | Reason] = LruCache(recaptures)
        # host path -> (module, call, key): the key worked out once for the module and call it was worked out for
        self.keys: LruCache[str, tuple[nn.Module, tuple[tuple, dict], HostKey]] = LruCache(limit)

    def key_of(self, module: nn.Module, host: str, inputs: tuple[tuple, dict]) -> HostKey:
        """The host's fingerprint, worked out once for the module and call it was worked out for (a Surgeon given
        an analysis asks again for each host of its model: the model analysed hands its keys over, ``hand_keys_to``;
        a model built alike has modules of its own)."""
        known = self.keys.get(host)
        if known is None or known[0] is not module or known[1] is not inputs:
            known = self.keys[host] = (module, inputs, fingerprint(module, *inputs))
        return known[2]

    def hand_keys_to(self, model: nn.Module) -> None:
        """Hand each host's fingerprint to the same host of ``model``, the model the analysed copy was made from just
        before (the copy is ``model`` as it was then: the fingerprints are its own)."""
        for host in self.keys.keys():
            _, inputs, key = self.keys[host]
            self.keys[host] = (model.get_submodule(host) if host else model, inputs, key)
