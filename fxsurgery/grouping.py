"""From labelled ids to unit groups.

Tied ids form classes (networkx connected components); a class that holds coordinates of a Linear's
output is a unit. Units that share a tensor axis form a group. A group is kept only when every
tensor it touches can be sliced along one axis in a regular ``[outer][unit][inner]`` layout, one
Linear reads it (the output projection), and every count-dependent constant can be rewritten.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import networkx as nx
import torch
import torch.fx

from . import constants as K
from . import ids as I
from .labelling import Labeller, Records
from .slicing import ParamSlice

NO_ID = I.NO_ID


@dataclass
class GroupSpec:
    """One unit group as found in one graph."""

    kind: str
    count: int
    members: list[ParamSlice]
    constants: list[K.ConstantSpec]
    exact: bool
    notes: list[str]
    modules: list[str]
    sink: str
    sink_node: str
    tap_outer: int  # the sink input's feature layout is [tap_outer][unit][tap_inner]
    tap_inner: int
    tap_dim: int  # the sink input's feature dim: -1 for a Linear, 1 for a pointwise convolution
    min_count: int


@dataclass
class Refusal:
    """A would-be group the analysis leaves out, and why."""

    modules: list[str]
    reasons: list[str]


@dataclass
class Analysis:
    groups: list[GroupSpec] = field(default_factory=list)
    refusals: list[Refusal] = field(default_factory=list)
    located: list[list[str]] = field(default_factory=list)  # modules of each candidate group


def classes(n: int, edges: list[torch.Tensor]) -> torch.Tensor:
    """Class representative (smallest id) of every id: connected components of the tie edges, by
    vectorised min-label propagation with pointer jumping (a few passes over the edge list)."""
    rep = torch.arange(n)
    if not edges:
        return rep
    e = I.unique_pairs(torch.cat(edges))
    a, b = e[:, 0], e[:, 1]
    while True:
        low = torch.minimum(rep[a], rep[b])
        new = rep.scatter_reduce(0, a, low, "amin").scatter_reduce(0, b, low, "amin")
        new = torch.minimum(new, new[new])
        while not torch.equal(new, new[new]):
            new = new[new]
        if torch.equal(new, rep):
            return rep
        rep = new


def join_parameters(rep: torch.Tensor, tentative: list[torch.Tensor]) -> torch.Tensor:
    """A parameter element used with one class only joins it (a per-unit parameter); one used with
    several classes is shared by them and stays out (e.g. a norm weight over the head dim)."""
    tent = [t for t in tentative if t.numel()]
    if not tent:
        return rep
    t = torch.cat(tent)
    pc = I.unique_pairs(torch.stack([rep[t[:, 0]], rep[t[:, 1]]], 1))
    pc = pc[pc[:, 0] != pc[:, 1]]
    ids, counts = torch.unique(pc[:, 0], return_counts=True)
    single = pc[torch.isin(pc[:, 0], ids[counts == 1])]
    remap = torch.arange(rep.numel())
    remap[single[:, 0]] = single[:, 1]
    return remap[rep]


def layout(u: torch.Tensor, n: int) -> tuple[int, int] | None:
    """(outer, inner) when unit indices ``u`` along a dim follow ``[outer][n][inner]``."""
    size = u.numel()
    if n == 0 or size % n or (u < 0).any():
        return None
    inner = 1
    while inner < size and u[inner] == u[0]:
        inner += 1
    if size % (n * inner):
        return None
    expected = (torch.arange(size) // inner) % n
    return (size // (n * inner), inner) if torch.equal(u, expected) else None


def _describe_layout(u: torch.Tensor, n: int) -> str:
    """Why unit indices ``u`` along a dim are no ``[outer][unit][inner]`` layout, for humans."""
    present = torch.unique(u[u >= 0]).tolist()
    if len(present) < n:
        spans = ", ".join(f"{a}-{b}" if a != b else f"{a}" for a, b in _runs(present))
        return (f"holds units {spans} of {n} only (each part of the units has a parameter of its own, "
                f"so the units cannot be sliced as one layer)")
    return f"holds all {n} units, but not in an [outer][unit][inner] order"


def _runs(values: list[int]) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for v in values:
        if runs and v == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], v)
        else:
            runs.append((v, v))
    return runs


def common_module(paths: Sequence[str]) -> str:
    """Deepest module that contains every path (dotted names)."""
    parts = [p.split(".") if p else [] for p in paths]
    if not parts:
        return ""
    out = []
    for level in zip(*parts):
        if len(set(level)) != 1:
            break
        out.append(level[0])
    return ".".join(out)


def module_of(node: torch.fx.Node) -> str:
    if node.op in ("call_module",):
        return node.target
    stack = node.meta.get("nn_module_stack")
    if stack:
        return list(stack.values())[-1][0]
    return ""


class _Builder:
    """Turns one labelling into group specs."""

    def __init__(self, lab: Labeller):
        self.lab, self.rec = lab, lab.rec
        rec: Records = self.rec
        self.rep = join_parameters(classes(rec.next_id, rec.edges), rec.tentative)
        n = rec.next_id
        is_space = torch.zeros(n, dtype=torch.bool)
        for start, stop, _ in rec.spaces:
            is_space[start:stop] = True
        self.unit_class = torch.zeros(n, dtype=torch.bool)
        self.unit_class[self.rep[is_space]] = True
        self.head = torch.zeros(n, dtype=torch.bool)
        for ids in rec.contracted:
            c = self.cls(ids)
            self.head[c[c >= 0]] = True
        self.benign = torch.zeros(n, dtype=torch.bool)
        self.hard: list[tuple[torch.Tensor, str]] = []  # (unit classes, reason they cannot be sliced)
        for pin in rec.pins:
            c = self.cls(pin.ids)
            if pin.dim is not None and not I.varies(c, pin.dim):
                continue
            c = torch.unique(c[(c >= 0)])
            c = c[self.unit_class[c]]
            if pin.benign:
                self.benign[c] = True
            elif c.numel():
                self.hard.append((c, pin.reason))
        self.mixed: dict[int, list[str]] = {}
        for p, why in rec.mixes:
            c = self.cls(p)
            diff = c[:, 0] != c[:, 1]
            for k in torch.unique(c[diff].flatten()).tolist():
                if k >= 0 and self.unit_class[k]:
                    self.mixed.setdefault(k, []).append(why)

        self.acts = []  # (node, output index, classes, unit classes present, from parameters only)
        for node, i, ids, param in rec.acts:
            c = self.cls(ids)
            present = torch.unique(c[c >= 0])
            self.acts.append((node, i, c, present[self.unit_class[present]], param))
        self.acts_of: dict[int, list] = {}

    def cls(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.where(ids >= 0, self.rep[ids.clamp(min=0)], ids.new_full((), NO_ID))

    def groups(self) -> list[list[int]]:
        """Unit classes that share a tensor axis belong to one group."""
        g, seen = nx.Graph(), set()
        for *_, present, param in self.acts:
            if param:
                continue  # parameters join units, they do not define which units share an axis
            if present.numel() and self.benign[present].all():
                continue  # only classes that are no unit axis (the residual stream): dropped anyway
            key = tuple(present.tolist())
            if key not in seen:
                seen.add(key)
                g.add_nodes_from(key)
                g.add_edges_from(zip(key, key[1:]))
        comps = [sorted(comp) for comp in nx.connected_components(g)]
        group_of = torch.full((self.rec.next_id,), NO_ID)
        for k, comp in enumerate(comps):
            group_of[torch.tensor(comp)] = k
        for act in self.acts:
            if act[3].numel():
                self.acts_of.setdefault(int(group_of[act[3][0]]), []).append(act)
        return comps

    def build(self, locate: bool) -> Analysis:
        out = Analysis()
        for k, units in enumerate(self.groups()):
            if locate:
                self.locate(k, units, out)
                continue
            try:
                spec = self.group(k, units)
            except K.Unsupported as e:
                out.refusals.append(Refusal(self.home_of(k, torch.tensor(units)), [str(e)]))
                continue
            if spec is None:
                continue
            if isinstance(spec, Refusal):
                out.refusals.append(spec)
            else:
                out.groups.append(spec)
        for node, why in self.rec.opaque:  # unless its module already tells of it (units it refused)
            told = [w for r in out.refusals if common_module(r.modules) == module_of(node) for w in r.reasons]
            if not any(w.startswith(f"{node.name}:") for w in told):
                out.refusals.append(Refusal([module_of(node)], [why]))
        return out

    def locate(self, k: int, units: list[int], out: Analysis) -> None:
        """Only where a candidate group lives (to pick the modules to trace on their own)."""
        ut = torch.tensor(units)
        if self.benign[ut].any():
            return
        hard = self.hard_reasons(units)
        sinks = self.sinks_of(ut)
        if not hard and isinstance(sinks, str):
            hard = [sinks]
        if hard:
            out.refusals.append(Refusal(self.home_of(k, ut), hard))
        else:
            out.located.append(self.modules_of(k))

    def hard_reasons(self, units: list[int]) -> list[str]:
        ut = torch.tensor(units)
        return sorted({why for c, why in self.hard if torch.isin(c, ut).any()})

    def modules_of(self, k: int) -> list[str]:
        return [module_of(act[0]) for act in self.acts_of.get(k, []) if not act[4]]

    def home_of(self, k: int, ut: torch.Tensor) -> list[str]:
        """Where a refused group lives, for the report: the modules of the linear maps that produce and read its
        units (its dataflow may pass through a module shared by several blocks); all its modules if none."""
        names = {node for start, stop, node in self.rec.spaces if torch.isin(self.rep[start:stop], ut).any()}
        names |= {node for _, node, col, _ in self.rec.sinks if torch.isin(self.cls(col), ut).any()}
        nodes = [n for n in self.lab.module.graph.nodes if n.name in names]
        return [module_of(n) for n in nodes] or self.modules_of(k)

    def group(self, k: int, units: list[int]) -> GroupSpec | Refusal | None:
        ut = torch.tensor(units)
        hard = self.hard_reasons(units)
        if hard:
            return Refusal(self.home_of(k, ut), hard)
        if self.benign[ut].any():
            return None  # not a unit axis (residual stream, model output)
        sinks = self.sinks_of(ut)
        if isinstance(sinks, str):
            return Refusal(self.home_of(k, ut), [sinks])
        sink, sink_node, col, sink_dim = sinks[0]
        order = list(dict.fromkeys(c for c in col.tolist() if c >= 0))
        n = len(units)
        if sorted(order) != units:
            return Refusal(self.home_of(k, ut), [f"{sink} reads only some of the units"])
        if n < 2:
            return Refusal(self.home_of(k, ut), ["a single unit: its axis cannot be located"])
        mods = self.modules_of(k)
        index = torch.full((self.rec.next_id,), NO_ID)
        index[torch.tensor(order)] = torch.arange(n)
        members = [self.member(name, ids, index, n, sink) for name, ids in self.rec.members]
        members = list(dict.fromkeys(m for m in members if m is not None))
        axes = self.unit_axes(k, index)
        consts, notes_zero = self.constants(axes, n)
        sink_member = next(m for m in members if m.output)
        mods += [m.name.rsplit(".", 1)[0] for m in members if "." in m.name]
        mixed = sorted({r for u in units for r in self.mixed.get(u, [])})
        kind = "head" if self.head[ut].any() else "channel"
        notes_zero += sorted({why for ids, why in self.rec.nonempty if torch.isin(self.cls(ids), ut).any()})
        min_count = 1 if (kind == "channel" or notes_zero) else 0
        return GroupSpec(kind, n, members, consts, not mixed, mixed + notes_zero, mods, sink, sink_node,
                         sink_member.outer, sink_member.inner, sink_dim, min_count)

    def sinks_of(self, ut: torch.Tensor) -> list[tuple[str, str, torch.Tensor, int]] | str:
        """The reads of units ``ut`` by the one linear map (output projection) that reads them, or
        why there is no such single map."""
        sinks = [(w, node, self.cls(col), dim) for w, node, col, dim in self.rec.sinks
                 if torch.isin(self.cls(col), ut).any()]
        names = sorted({w for w, *_ in sinks})
        if len(names) != 1:
            if not names:
                return "no linear map reads these units"
            shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            return f"read by several linear maps ({shown}): a width shared by layers, not one layer's units"
        return sinks

    def member(self, name: str, ids: torch.Tensor, index: torch.Tensor, n: int, sink: str) -> ParamSlice | None:
        c = self.cls(ids)
        u = torch.where(c >= 0, index[c.clamp(min=0)], c)
        if not (u >= 0).any():
            return None
        shape = self.shape_of(name)
        u = I.align(u, len(shape))
        dims = [d for d in range(u.dim()) if I.varies(u, d)]
        if not dims:  # one unit only, of n >= 2
            raise K.Unsupported(f"{name}: {_describe_layout(u.flatten(), n)}")
        if len(dims) > 1:
            raise K.Unsupported(f"{name}: units vary along {len(dims)} dims")
        d = dims[0]
        other = [k for k in range(u.dim()) if k != d]
        u1 = u.amax(dim=other, keepdim=True) if other else u
        if not ((u == u1) | (u == NO_ID)).all():
            raise K.Unsupported(f"{name}: elements of one slice belong to different units")
        lay = layout(u1.flatten().expand(shape[d]) if u1.numel() == 1 else u1.flatten(), n)
        if lay is None:
            raise K.Unsupported(f"{name}: {_describe_layout(u1.flatten(), n)} along dim {d}")
        return ParamSlice(name, d, lay[0], lay[1], name == sink and d == 1)

    def shape_of(self, name: str) -> tuple[int, ...]:
        root = self.lab.module
        try:
            return tuple(root.get_parameter(name).shape)
        except AttributeError:
            return tuple(root.get_buffer(name).shape)

    def unit_axes(self, k: int, index: torch.Tensor) -> dict[tuple, int]:
        """The unit axis of every value that carries the group's units (parameter-derived values too:
        a per-head scale reshaped to (1, H, 1, 1) holds a constant)."""
        axes = {}
        for node, i, c, _, param in self.acts_of.get(k, []):
            u = torch.where(c >= 0, index[c.clamp(min=0)], c)
            if not (u >= 0).any():
                continue
            dims = [d for d in range(u.dim()) if I.varies(u, d)]
            if param and len(dims) != 1:
                continue
            if len(dims) != 1:
                raise K.Unsupported(f"{node.name}: carries the units along {len(dims)} axes")
            if (u < 0).any() and not param:
                raise K.Unsupported(f"{node.name}: mixes units with other coordinates on the unit axis")
            axes[(node, i)] = dims[0]
        return axes

    def constants(self, axes: dict[tuple, int], n: int) -> tuple[list[K.ConstantSpec], list[str]]:
        consts, notes = [], []
        lab = self.lab
        for node in lab.module.graph.nodes:
            src = node.args[0] if node.args and isinstance(node.args[0], torch.fx.Node) else None
            in_dim = axes.get((src, None)) if src is not None else None
            out_dim = axes.get((node, None))
            if in_dim is None and out_dim is None:
                continue
            site = K.Site(node, in_dim, out_dim, lab.shapes.get(src), lab.shapes.get(node), n,
                          lab.rec.size_reads, lab.values, axes)
            found = K.find(site)
            consts += found
            if node.op == "call_method" and node.target in ("view", "reshape") and out_dim is not None:
                paths = K.shape_paths(node, 1)
                if any(K.get_path(node, p) == -1 for k, p in enumerate(paths) if k != out_dim):
                    notes.append(f"{node.name}: a -1 beside the unit axis is ambiguous at zero units")
        return consts, notes


def analyse(lab: Labeller, locate: bool = False) -> Analysis:
    """Group specs and refusals of a graph that ``lab`` has run; with ``locate``, only where the
    candidate groups are."""
    return _Builder(lab).build(locate)
