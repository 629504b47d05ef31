"""From labelled ids to unit groups.

Tied ids form classes (connected components of the ties); a class that holds coordinates of a space
is a unit. Units that share a tensor axis form a group. A group is kept only when every
tensor it touches can be sliced along one axis in a regular ``[outer][unit][inner]`` layout, one
Linear reads it (the output projection; or several that read one value, for channels fanned out to parallel maps; or
several of the heads' own layer, each reading every head, as bilinear attention's), and every count-dependent constant
can be rewritten.
"""
from __future__ import annotations

import functools
import operator
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch
import torch.fx
from torch.fx.node import Node

from ..reason import Reason
from ..slicing import ParamSlice
from ..unit_kind import UnitKind
from .classes import ClassIndex, classes, join_parameters, shared_uses
from .constants import ConstantSpec, Site, Unsupported
from .gates import silent_softmaxes
from .ids import NO_ID, align, compact, varies
from .labeller import Labeller
from .paths import common_module, module_of, tensor_at, within
from .records import Act, Member, Sink, Space, TapLayout
from .rules import RULES
from .single_head import HeadAct, SingleHead
from .unit_layout import describe_layout, layout, pieces, segment
from .widening import repeat_axes


@dataclass(kw_only=True)
class GroupSpec:
    """One unit group as found in one graph: the grouping's output, before a host's train and eval graphs are
    matched (``analysis.host.HostGroup``) and a group is described to users (``groups.GroupDescription``)."""

    kind: UnitKind
    count: int
    members: list[ParamSlice]
    constants: list[ConstantSpec]
    exact: bool
    notes: list[str]
    modules: list[str]
    sink: str  # the output projection's weight
    sites: list[TapSite]  # where the graph hands the units on: each call of the projection, each mixing map
    min_count: int


class TapSite(NamedTuple):
    """A call that reads a group's units (``sink``: its output projection, or a map that mixes its heads), the node
    of the activations it reads (``input``) and where the units lie in them."""

    sink: Node
    input: Node
    layout: TapLayout


@dataclass
class Refusal:
    """A would-be group the analysis leaves out, and why. ``at_output``: its heads reach the graph's outputs
    (a module that returns per-head values), so the module's caller, which may drop them, should host it."""

    modules: list[str]
    reasons: list[str]
    at_output: bool = False


HEADS_AT_OUTPUT = "per-head values reach the module's outputs"
_LARGE = 4096  # ids of a value above this size are compacted before their classes are sorted
_SUM_FUNCTIONS = {operator.add, operator.iadd, operator.sub, operator.isub, torch.add, torch.sub}
_SUM_METHODS = {"add", "add_", "sub", "sub_"}


@dataclass
class GraphGroups:
    """What grouping found in one graph."""

    groups: list[GroupSpec] = field(default_factory=list)
    refusals: list[Refusal] = field(default_factory=list)
    located: list[list[str]] = field(default_factory=list)  # modules of each candidate group


class UnitAct(NamedTuple):
    """A labelled value seen in classes: its ids' classes, and which unit classes it carries."""

    node: torch.fx.Node
    index: int | None
    classes: torch.Tensor
    units: torch.Tensor
    param: bool
    ids: torch.Tensor  # the raw ids (feature coordinates), before classes


class _Builder:
    """Turns one labelling into group specs. ``returns_units``: channels that reach the graph's outputs may still be
    units (a call of a new signature, whose graph returns them at their group's current width); otherwise they are
    no unit axis (the residual stream a caller reads)."""

    def __init__(self, lab: Labeller, returns_units: bool = False):
        self.lab, self.rec = lab, lab.rec
        rec = self.rec
        self.rep = join_parameters(classes(rec.next_id, rec.ties + shared_uses(rec.members)), rec.tentative)
        n = rec.next_id
        self.is_space = torch.zeros(n, dtype=torch.bool)
        for space in rec.spaces:
            self.is_space[space.start:space.stop] = True
        self.unit_class = torch.zeros(n, dtype=torch.bool)
        self.unit_class.index_fill_(0, self.rep.masked_select(self.is_space), True)
        self.head = torch.zeros(n, dtype=torch.bool)
        if rec.contracted:  # the classes of all of them in one gather
            c = self.cls(torch.cat([ids.reshape(-1) for ids in rec.contracted]))
            self.head.index_fill_(0, c.masked_select(c >= 0), True)
        self.benign = torch.zeros(n, dtype=torch.bool)
        # (unit classes, reason they cannot be sliced, whether it is only that they are per-head values returned)
        self.hard: list[tuple[torch.Tensor, str, bool]] = []
        for pin in rec.pins:
            c = self.cls(pin.ids)
            if pin.dim is not None and not varies(c, pin.dim):
                continue
            c = torch.unique(c[(c >= 0)])
            c = c[self.unit_class[c]]
            if pin.at_output and self.head[c].any():  # returned per-head values: not the residual stream
                self.hard.append((c[self.head[c]], f"{pin.reason.split(':')[0]}: {HEADS_AT_OUTPUT}", True))
                c = c[~self.head[c]]
            elif pin.benign and self.head[c].any():  # heads meet a tensor that cannot be sliced: told, not dropped
                self.hard.append((c[self.head[c]], pin.reason, False))
                c = c[~self.head[c]]
            if not pin.benign:
                if c.numel():
                    self.hard.append((c, pin.reason, False))
            elif not (pin.at_output and returns_units):  # channels a recaptured call returns stay candidates
                self.benign[c] = True
        self.acts = self.unit_acts(rec.acts)
        self.sinks = [sink._replace(columns=self.cls(sink.columns)) for sink in rec.sinks]  # columns as classes
        self.acts_of: dict[int, list[UnitAct]] = {}  # group index -> the values that carry its units
        self.sinks_by_group: list[list[int]] = []  # group index -> the sinks that read its units (by ``groups``)

    @functools.cached_property
    def sink_index(self) -> ClassIndex:
        """The classes each sink reads."""
        return ClassIndex([sink.columns for sink in self.sinks], self.rec.next_id)

    @functools.cached_property
    def mix_index(self) -> ClassIndex:
        """The classes each mix joins to other classes (a map that mixes heads)."""
        mixed = []
        for mix in self.rec.mixes:
            c = self.cls(mix.pairs)
            mixed.append(c[c[:, 0] != c[:, 1]].flatten())
        return ClassIndex(mixed, self.rec.next_id)

    @functools.cached_property
    def space_index(self) -> ClassIndex:
        """The classes of each space's coordinates."""
        return ClassIndex([self.rep[sp.start:sp.stop] for sp in self.rec.spaces], self.rec.next_id)

    def spaces_of(self, ut: torch.Tensor) -> list[Space]:
        """The spaces that give units ``ut`` coordinates, in recording order."""
        return [self.rec.spaces[i] for i in self.space_index.holding(ut)]

    def unit_acts(self, acts: list[Act]) -> list[UnitAct]:
        """Each labelled value with its ids as classes and the unit classes it carries, in ascending order. Values
        that share their ids (a norm or a dropout passes its input's on, a reshape views them) are worked out once
        and share the result; the others are worked out together, in one pass over all their ids."""
        position: dict[tuple, int] = {}
        distinct: list[torch.Tensor] = []
        slot = []  # each value's position among the distinct ones
        for act in acts:
            slot.append(position.setdefault(_layout(act.ids), len(distinct)))
            if slot[-1] == len(distinct):
                distinct.append(act.ids)
        if not distinct:
            return []
        flat = self.cls(torch.cat([t.reshape(-1) for t in distinct]))
        classes_of = [c.view(t.shape) for c, t in zip(torch.split(flat, [t.numel() for t in distinct]), distinct)]
        units = _units_held(classes_of, self.unit_class)
        return [UnitAct(act.node, act.index, classes_of[k], units[k], act.param, act.ids) for act, k in zip(acts, slot)]

    def cls(self, ids: torch.Tensor) -> torch.Tensor:
        """The classes of ``ids`` (``NO_ID`` kept), by one gather over them flattened (cheaper than indexing)."""
        found = self.rep.index_select(0, ids.clamp(min=0).reshape(-1)).view(ids.shape)
        return torch.where(ids >= 0, found, ids.new_full((), NO_ID))

    def groups(self) -> list[torch.Tensor]:
        """Unit classes that share a tensor axis belong to one group (in order of first appearance)."""
        # parameters join units, they do not define which units share an axis; values whose classes are all no
        # unit axis (the residual stream) are dropped anyway
        held = {id(act.units): act.units for act in self.acts if not act.param}  # values that share ids share units
        # a value's classes that are no unit axis (a key/value head that every query head reads, fused beside
        # them) join nothing: the units beside them are grouped as they would be apart
        held = {key: u[~self.benign[u]] for key, u in held.items()}
        axes = list({u.numpy().tobytes(): u for u in held.values() if u.numel()}.values())
        axes = [a for a in axes if not self.fused(a, axes)]
        units, edges = _first_appearance(axes, self.rec.next_id)
        comps = _components(units, classes(len(units), [edges]), self.rec.next_id)
        group_of = torch.full((self.rec.next_id,), NO_ID)
        for k, comp in enumerate(comps):
            group_of[comp] = k
        self.sinks_by_group = self.sink_index.by_group(group_of, len(comps))
        carriers = [act for act in self.acts if act.units.numel()]
        first, alone = _group_of_first(group_of, [act.units for act in carriers])
        for act, k in zip(carriers, first):
            self.acts_of.setdefault(k, []).append(act)
        for act, one in zip(carriers, alone):  # a value that holds several groups' units side by side (a fused
            if not act.param and not one:  # projection's output) is listed with each of them
                for k in torch.unique(group_of[act.units[1:]]).tolist():
                    if act not in self.acts_of.setdefault(k, []):
                        self.acts_of[k].append(act)
        return comps

    def fused(self, units: torch.Tensor, axes: list[torch.Tensor]) -> bool:
        """A value that holds attention heads and FFN channels side by side (the output of a projection fused for
        a parallel block, the concatenation its output projection reads), each part carried alone by other values
        (the parts it is split into): it does not join them into one group."""
        heads = self.head[units]
        if heads.all() or not heads.any():
            return False
        parts = [a for a in axes if a.numel() < units.numel() and bool(torch.isin(a, units).all())]
        head_parts = torch.cat([a for a in parts if self.head[a].all()] + [units[:0]])
        channel_parts = torch.cat([a for a in parts if not self.head[a].any()] + [units[:0]])
        return bool(torch.isin(units[heads], head_parts).all() and torch.isin(units[~heads], channel_parts).all())

    def build(self, locate: bool) -> GraphGroups:
        out = GraphGroups()
        offered = [torch.empty(0, dtype=torch.long)]
        for k, ut in enumerate(self.groups()):
            if locate:
                offered += [ut] if self.locate(k, ut, out) else []
                continue
            try:
                spec = self.group(k, ut)
            except Unsupported as e:
                out.refusals.append(Refusal(self.home_of(k, ut), [str(e)]))
                continue
            if spec is None:
                continue
            if isinstance(spec, list):
                out.refusals += spec
            elif isinstance(spec, Refusal):
                out.refusals.append(spec)
            else:
                out.groups.append(spec)
        self.refuse_overlaps(out)
        self.hold_untiled(out)
        if locate:  # each region is located once; its hosts' analyses would tell it again
            told = silent_softmaxes(self, torch.cat(offered))
            out.refusals += [Refusal([module_of(t.node)], [t.reason]) for t in told]
        if not locate:  # told once the groups are built, where none is
            out.refusals += self.unstarted_refusals(out)
        for opaque in self.rec.opaque:  # unless its module already tells of it (units it refused)
            where = module_of(opaque.node)
            told = [w for r in out.refusals if common_module(r.modules) == where for w in r.reasons]
            if not any(w.startswith(f"{opaque.node.name}:") for w in told):
                out.refusals.append(Refusal([where], [opaque.reason]))
        return out

    def unstarted_refusals(self, out: GraphGroups) -> list[Refusal]:
        """Each module that multiplies by a parameter laying out the output, as no linear map (``x @ (W * mask)``), and
        ends with no group at, under or (below the root) above it, nor a refusal of its own: why its units are not
        found."""
        grouped = [m for spec in out.groups for m in spec.modules]
        told = {common_module(r.modules) for r in out.refusals}
        refusals: dict[str, Refusal] = {}
        for note in self.rec.unstarted:
            where = module_of(note.node)
            if where in refusals or where in told or any(within(m, where) or (m and within(where, m))
                                                          for m in grouped):
                continue
            refusals[where] = Refusal([where], [note.reason])
        return list(refusals.values())

    @staticmethod
    def refuse_overlaps(out: GraphGroups) -> None:
        """Two groups slicing overlapping parts of one tensor along one dim (a module called more than once whose
        listings could not be told apart) would corrupt each other: both are refused. Groups in disjoint segments
        of the dim (a fused projection's rows) share the tensor."""
        owners: dict[tuple, list[tuple[GroupSpec, int, int]]] = {}
        for spec in out.groups:
            for m in spec.members:
                owners.setdefault((m.name, m.dim), []).append((spec, m.start, m.start + m.outer * spec.count * m.inner))
        clashes = {(name, id(g)) for (name, _), spans in owners.items() for g, start, stop in spans
                   if any(other is not g and start < other_stop and other_start < stop
                          for other, other_start, other_stop in spans)}
        for spec in list(out.groups):
            names = sorted({name for name, gid in clashes if gid == id(spec)})
            if names:
                out.groups.remove(spec)
                out.refusals.append(Refusal(spec.modules, [f"{', '.join(names)}: sliced by another group too "
                                                           "(a module called more than once)"]))

    def hold_untiled(self, out: GraphGroups) -> None:
        """The elements of a dim that the segments of the groups found leave to no group (a multi-query projection's
        key and value rows beside its query heads) stay whatever the counts: each slice there records how many
        (``fixed``), so the dim's size still tells the counts of the groups on it. A group on a dim whose groups
        overfill it is refused."""
        spans: dict[tuple, list[tuple[GroupSpec, int]]] = {}
        for spec in out.groups:
            for m in spec.members:
                spans.setdefault((m.name, m.dim), []).append((spec, m.outer * spec.count * m.inner))
        for (name, dim), held in spans.items():
            rest = self.shape_of(name)[dim] - sum(size for _, size in held)
            for spec, _ in held:
                if rest < 0 and spec in out.groups:
                    out.groups.remove(spec)
                    out.refusals.append(Refusal(spec.modules, [f"{name}: the units overfill dim {dim}"]))
                elif rest > 0:
                    spec.members = [replace(m, fixed=rest) if (m.name, m.dim) == (name, dim) else m
                                    for m in spec.members]

    def locate(self, k: int, ut: torch.Tensor, out: GraphGroups) -> bool:
        """Only where a candidate group lives (to pick the modules to trace on their own); True if located."""
        hard = self.hard_reasons(ut)
        if self.benign[ut].any() and not hard:
            return False
        sinks = self.sinks_of(k, ut)
        if hard:
            out.refusals += self.refusals_of(k, ut, hard, at_output=self.at_output(ut))
            return False
        if isinstance(sinks, Reason):
            out.refusals += self.refusals_of(k, ut, [sinks.text])
            return False
        # the output projection may sit in a sibling module (an "output" block beside "self" attention)
        out.located.append(self.modules_of(k) + [sink.weight.rpartition(".")[0] for sink in sinks])
        return True

    def hard_reasons(self, ut: torch.Tensor) -> list[str]:
        return sorted({why for c, why, _ in self.hard if torch.isin(c, ut).any()})

    def at_output(self, ut: torch.Tensor) -> bool:
        """Whether the only reason units ``ut`` cannot be sliced is that their per-head values reach the outputs."""
        return all(returned for c, _, returned in self.hard if torch.isin(c, ut).any())

    def modules_of(self, k: int) -> list[str]:
        return [module_of(act.node) for act in self.acts_of.get(k, []) if not act.param]

    def home_of(self, k: int, ut: torch.Tensor) -> list[str]:
        """Where a refused group lives, for the report: the modules of the linear maps that produce and read its
        units (its dataflow may pass through a module shared by several blocks); all its modules if none."""
        names = {sp.node for sp in self.spaces_of(ut)}
        names |= {sink.node for sink in self.sinks_reading(ut)}
        nodes = [n for n in self.lab.module.graph.nodes if n.name in names]
        return [module_of(n) for n in nodes] or self.modules_of(k)

    def group(self, k: int, ut: torch.Tensor) -> GroupSpec | Refusal | list[Refusal] | None:
        units = ut.tolist()
        hard = self.hard_reasons(ut)
        if hard:
            return Refusal(self.home_of(k, ut), hard, self.at_output(ut))
        if self.benign[ut].any():
            return None  # not a unit axis (residual stream, model output)
        sinks = self.sinks_of(k, ut)
        if isinstance(sinks, Reason):
            return self.refusals_of(k, ut, [sinks.text])
        sink = sinks[0]
        own = set(units)  # a fused output projection reads other groups' units beside these
        order = list(dict.fromkeys(c for c in sink.columns.tolist() if c in own))
        n = len(units)
        read = {}  # the units each projection reads, over its calls
        for s in sinks:
            read.setdefault(s.weight, set()).update(c for c in s.columns.tolist() if c in own)
        partial = next((weight for weight, found in read.items() if sorted(found) != units), None)
        if partial:
            return Refusal(self.home_of(k, ut), [f"{partial} reads only some of the units"])
        mods = self.modules_of(k)
        index = torch.full((self.rec.next_id,), NO_ID)
        index[torch.tensor(order)] = torch.arange(n)
        if n < 2 and not self.one_coordinate(ut):
            members, axes = self.single_head(k, index, sink)
            segments = {}
        else:
            members = list(dict.fromkeys(sl for m in self.rec.members for sl in self.member(m, index, n, sinks)))
            axes, segments = self.unit_axes(k, index, n)
        consts, notes_zero = self.constants(axes, segments, n)
        read_by = {m.name: m for m in members if m.output}
        mods += [m.name.rsplit(".", 1)[0] for m in members if "." in m.name]
        mixed = sorted({self.rec.mixes[i].reason for i in self.mix_index.holding(ut)})
        kind = UnitKind.HEAD if self.head[ut].any() else UnitKind.CHANNEL
        notes_zero += sorted({ne.reason for ne in self.rec.nonempty if torch.isin(self.cls(ne.ids), ut).any()})
        min_count = 1 if (kind == UnitKind.CHANNEL or notes_zero) else 0
        about = sorted({note.text for note in self.rec.notes if torch.isin(self.cls(note.ids), ut).any()})
        about += self.fused_note(kind, members, n)
        return GroupSpec(kind=kind, count=n, members=members, constants=consts, exact=not mixed,
                         notes=about + mixed + notes_zero, modules=mods, sink=sink.weight,
                         sites=self.sites(sinks, ut, read_by, axes, segments), min_count=min_count)

    def fused_note(self, kind: UnitKind, members: list[ParamSlice], n: int) -> list[str]:
        """What a unit is where the group holds segments of a dim: beside other groups' (a parallel block's fused
        projections), or several pieces of its own (a fused q/k/v projection of grouped-query attention); its parts
        in each, said once."""
        pieced = [m for m in members if m.start or m.after]
        own: dict[tuple[str, int], int] = {}
        for m in pieced:
            own[(m.name, m.dim)] = own.get((m.name, m.dim), 0) + m.outer * n * m.inner
        notes = []
        for alone in (False, True):
            parts = [f"{m.inner} entr{'y' if m.inner == 1 else 'ies'}"
                     f"{f' in each of {m.outer} sections' if m.outer > 1 else ''} of {m.name}'s dim {m.dim}"
                     for m in pieced if (own[(m.name, m.dim)] == self.shape_of(m.name)[m.dim]) == alone]
            if parts and alone:
                notes.append(f"a unit is one {kind.noun} in pieces of a fused projection of its own: {', '.join(parts)}"
                             " (an edit of one piece moves the pieces after it)")
            elif parts:
                notes.append(f"a unit is one {kind.noun} of a projection fused with other layers: {', '.join(parts)}, "
                             "in a segment beside the other layers' (an edit moves the segments after it)")
        return notes

    def sites(self, sinks: list[Sink], ut: torch.Tensor, read_by: dict[str, ParamSlice], axes: dict[tuple, int],
              segments: dict[tuple, tuple[int, int]]) -> list[TapSite]:
        """Every place the units leave for other units, with its input node: the calls of the output projections
        (the units laid out there as the projection's ``read_by`` slice says) and the maps that mix them with other
        heads (a removal masks a head at each). None if one is out of sight (an opaque function's body): no tap
        could see every use."""
        reads = [r for r in self.rec.mix_reads if torch.isin(self.cls(r.heads), ut).any()]
        if any(sink.input is None for sink in sinks) or any(r.input is None for r in reads):
            return []
        nodes = {n.name: n for n in self.lab.module.graph.nodes}
        return [self.piece_site(TapSite(nodes[sink.node], nodes[sink.input],
                                        TapLayout(read_by[sink.weight].outer, read_by[sink.weight].inner, sink.dim)),
                                axes, segments)
                for sink in sinks] + \
            [TapSite(nodes[r.node], nodes[r.input], TapLayout(1, 1, r.dim)) for r in reads]

    @staticmethod
    def piece_site(site: TapSite, axes: dict[tuple, int], segments: dict[tuple, tuple[int, int]]) -> TapSite:
        """A projection that reads the units in a segment of its input (a fused output projection reading the
        concatenation of attention and MLP outputs) is tapped on the concatenation's piece that holds them alone:
        the piece's width follows the count, the segment's offset may follow other groups'."""
        if (site.input, None) not in segments:
            return site
        src = site.input
        pieces = src.args[0] if src.op == "call_function" and src.target in (torch.cat, torch.concat) else ()
        held = [p for p in pieces if isinstance(p, Node) and (p, None) in axes and (p, None) not in segments]
        if len(held) != 1:
            raise Unsupported(f"{site.sink.name}: reads the units in a segment of {src.name}, whose part holding "
                              "them alone no tap point can see")
        return TapSite(src, held[0], site.layout._replace(dim=axes[(held[0], None)]))

    def refusals_of(self, k: int, ut: torch.Tensor, reasons: list[str], at_output: bool = False) -> list[Refusal]:
        """Why units ``ut`` are left out, at their home; units of several layers tied only through a parameter
        they all use (a module every block calls) are told at each layer that makes or reads them (the module of
        its projection), with that parameter."""
        shared = self.shared_members(ut)
        layers = sorted({s.weight.rpartition(".")[0].rpartition(".")[0] for s in self.sinks_reading(ut)}
                        | {p.rpartition(".")[0] for p in self.producers(ut)})  # the layers that read or make them
        if not shared or len(layers) < 2:
            return [Refusal(self.home_of(k, ut), reasons, at_output)]
        return [Refusal([m], [f"units tied to those of {listed([o or '(model)' for o in layers if o != m])} through "
                              f"{listed(shared)}, which all of them use: a parameter shared by layers cannot be "
                              "sliced for one of them"])
                for m in layers]

    def shared_members(self, ut: torch.Tensor) -> list[str]:
        """Parameters listed by several calls whose elements belong to units ``ut``."""
        listings: dict[tuple, list[Member]] = {}
        for m in self.rec.members:
            listings.setdefault((m.name, tuple(m.ids.shape)), []).append(m)
        return sorted({name for (name, _), found in listings.items()
                       if len(found) > 1 and sum(bool(torch.isin(self.cls(m.ids), ut).any()) for m in found) > 1})

    def sinks_of(self, k: int, ut: torch.Tensor) -> list[Sink] | Reason:
        """The reads of units ``ut`` (group ``k``; columns as classes) by the one linear map (output projection)
        that reads them, or by several maps that all read one value (channels fanned out to parallel projections,
        as a query and a key/value map read one input: a channel removed leaves all of them), or heads read by
        several maps of their own layer (``own_reads``); or why there is no such reader."""
        sinks = [self.sinks[i] for i in self.sinks_by_group[k]]
        names = sorted({sink.weight for sink in sinks})
        fanned_out = len({sink.input for sink in sinks}) == 1 and sinks[0].input is not None
        if len(names) != 1 and not (fanned_out and not self.head[ut].any()):
            if not names:
                return Reason("no linear map reads these units")
            shown = listed(names)
            if len(names) == len(sinks) and self.read_apart(sinks, ut):
                return Reason(f"{', '.join(self.producers(ut))} produces the units of several layers in one "
                              f"tensor, read apart by {shown}: a fused projection of parallel layers cannot be sliced "
                              "per layer")
            cascade = self.cascade(sinks, ut) if self.head[ut].any() else None
            if cascade is not None:
                return cascade
            if self.head[ut].any() and self.own_reads(k, sinks, ut):
                return sinks
            if self.head[ut].any():  # an attention without an output projection adds its heads to the stream
                return Reason(f"attention heads read by several linear maps ({shown}) and no output projection of "
                              "their own: their values are the width of the stream they join, not units of one layer")
            return Reason(f"read by several linear maps ({shown}): a width shared by layers, not one layer's units")
        return sinks

    def own_reads(self, k: int, sinks: list[Sink], ut: torch.Tensor) -> bool:
        """Heads read by several maps at values of their own layer (bilinear attention: the map that makes every
        head's transform reads the heads' channels, and the output projection reads them transformed): every map
        reads every head, and no sum of two values that carry them is what a map reads (a residual stream, whose width
        they would be; a score bias or a rotary embedding summed before the attention's product is no stream).
        Masking a head at each read equals removing it; the tap point sees it at each."""
        if any(sink.input is None for sink in sinks):
            return False
        read: dict[str, set[int]] = {}
        for sink in sinks:
            read.setdefault(sink.weight, set()).update(sink.columns[torch.isin(sink.columns, ut)].tolist())
        if any(len(units) != len(ut) for units in read.values()):
            return False
        carriers = {act.node for act in self.acts_of.get(k, []) if not act.param}
        mapped = {sink.input for sink in self.sinks if sink.input is not None}
        return not _sum_read(carriers, readers={sink.node for sink in sinks}, mapped=mapped)

    def read_apart(self, sinks: list[Sink], ut: torch.Tensor) -> bool:
        """No unit of ``ut`` is read by two of ``sinks`` (columns as classes): one pass over all their columns."""
        columns = torch.cat([sk.columns for sk in sinks])
        reader = torch.repeat_interleave(torch.arange(len(sinks)), torch.tensor([sk.columns.numel() for sk in sinks]))
        read = torch.isin(columns, ut)
        units = torch.unique(reader[read] * self.rec.next_id + columns[read]) % self.rec.next_id  # once per reader
        return torch.unique(units).numel() == units.numel()

    def cascade(self, sinks: list[Sink], ut: torch.Tensor) -> Reason | None:
        """Why heads that feed later heads are no units, or None: one map reads every head (their output
        projection) and other maps each read only some, at other values (a head's output added to the next head's
        input, as in cascaded group attention). Masking a head is well defined (its output zeroed at both reads),
        but a removal equal to it rewires what the heads after it read and a clone in the cascade reads another input
        than the head it copies, which no slice of a tensor does."""
        read: dict[str, set[int]] = {}
        for sink in sinks:
            read.setdefault(sink.weight, set()).update(sink.columns[torch.isin(sink.columns, ut)].tolist())
        every = [weight for weight, units in read.items() if len(units) == len(ut)]
        later = [sink for sink in sinks if sink.weight not in every]
        if len(every) != 1 or not later or any(sink.input is None for sink in later):
            return None
        first = later[0]
        more = f" (and {len(later) - 1} more maps, each at its own value)" if len(later) > 1 else ""
        return Reason(f"attention heads that feed later heads: {first.weight} reads some of them at {first.input}"
                      f"{more}, besides their output projection {every[0]}; no head is a unit, because each head "
                      "reads its own part of the input plus the previous head's output through maps of its own, so "
                      "removing a head would rewire the cascade and a clone would read another input than the head "
                      "it copies, edits that no slice of a tensor makes", node=first.input)

    def sinks_reading(self, ut: torch.Tensor) -> list[Sink]:
        """The sinks that read any of units ``ut`` (columns as classes), in recording order."""
        return [self.sinks[i] for i in self.sink_index.holding(ut)]

    def producers(self, ut: torch.Tensor) -> list[str]:
        """Modules of the linear maps whose spaces give units ``ut`` their coordinates."""
        names = {sp.node for sp in self.spaces_of(ut)}
        return sorted({module_of(n) for n in self.lab.module.graph.nodes if n.name in names})

    def member(self, m: Member, index: torch.Tensor, n: int, sinks: list[Sink]) -> list[ParamSlice]:
        """The slices of a member listing whose ids belong to the units (one per piece of its dim laid out as
        ``[outer][unit][inner]``: several in a fused q/k/v projection of grouped-query attention), or none; their read
        side (a sink's columns, a head-mixing map's rows) is an ``output`` slice."""
        name = m.name
        c = self.cls(m.ids)
        u = torch.where(c >= 0, index[c.clamp(min=0)], c)
        if not (u >= 0).any():
            return []
        shape = self.shape_of(name)
        u = align(u, len(shape))
        dims = [d for d in range(u.dim()) if varies(u, d)]
        read_dim = next((sink.weight_dim for sink in sinks if sink.weight == name), None)  # None: no sink's weight
        if not dims and n == 1:  # a unit of one coordinate: its axis is a size-1 dim (columns, for a sink)
            ones = [d for d in range(len(shape)) if shape[d] == 1]
            at_sink = read_dim in ones
            d = read_dim if at_sink else next(iter(ones), None)
            if d is None:
                raise Unsupported(f"{name}: one unit of one coordinate, but no dim of size 1 holds it")
            return [ParamSlice(name, d, 1, 1, at_sink)]
        if not dims:  # one unit only, of n >= 2
            raise Unsupported(f"{name}: {describe_layout(u.flatten(), n)}")
        if len(dims) > 1:
            raise Unsupported(f"{name}: units vary along {len(dims)} dims")
        d = dims[0]
        other = [k for k in range(u.dim()) if k != d]
        u1 = u.amax(dim=other, keepdim=True) if other else u
        if not ((u == u1) | (u == NO_ID)).all():
            raise Unsupported(f"{name}: elements of one slice belong to different units")
        u1 = u1.flatten().expand(shape[d]) if u1.numel() == 1 else u1.flatten()
        found = pieces(u1, n)
        if found is None:
            raise Unsupported(f"{name}: {describe_layout(u1, n)} along dim {d}")
        return [ParamSlice(name, d, outer, inner, m.output or d == read_dim, start, u1.numel() - stop)
                for start, stop, outer, inner in found]

    def single_head(self, k: int, index: torch.Tensor, sink: Sink) -> tuple[list[ParamSlice], dict[tuple, int]]:
        """Members and axes of a group of one head of several coordinates: its projections' rows and columns lie
        along the dim of their coordinate ids, every other tensor of the head along the dim the graph tells."""
        head = SingleHead(self.lab, [HeadAct(a.node, a.index, a.ids, a.param) for a in self.acts_of.get(k, [])])
        members, seeds = [], {}
        for name, ids, _ in self.rec.members:
            c = self.cls(ids)
            unit = torch.where(c >= 0, index[c.clamp(min=0)], c) >= 0
            if not unit.any():
                continue
            shape = self.shape_of(name)
            if bool(self.is_space[ids[unit]].all()):
                members.append((name, ids, unit, shape))
            else:  # a tensor of the head's own (one id per element), or one every head reads alike
                found = head.element_seed(name, shape)
                seeds.update(found)
                if found:
                    members.append(ParamSlice(name, next(iter(found.values())), 1, 1, False))
        axes = head.axes(seeds)  # also where reshapes split and merge the coordinates
        slices = [m if isinstance(m, ParamSlice) else head.coordinate_slice(*m, sink) for m in members]
        return list(dict.fromkeys(slices)), axes

    def shape_of(self, name: str) -> tuple[int, ...]:
        return tuple(tensor_at(self.lab.module, name).shape)

    def unit_axes(self, k: int, index: torch.Tensor, n: int) -> tuple[dict[tuple, int], dict[tuple, tuple[int, int]]]:
        """The unit axis of every value that carries the group's units (parameter-derived values too:
        a per-head scale reshaped to (1, H, 1, 1) holds a constant), and the segment (start, stop) of that axis
        the units fill in the values that hold other coordinates beside them (a fused projection's output)."""
        axes, segments = {}, {}
        for act in self.acts_of.get(k, []):
            c = act.classes
            u = torch.where(c >= 0, index[c.clamp(min=0)], c)
            if not (u >= 0).any():
                continue
            dims = [d for d in range(u.dim()) if _varies_among_units(u, d)]
            if n == 1:  # a unit of one coordinate lies along a dim of size 1 (the only one, to be sure)
                dims = self.size_one_dims(act)
                if len(dims) > 1 and not act.param and RULES.constants_hook(act.node):
                    raise Unsupported(f"{act.node.name}: one unit of one coordinate, but dims {dims} all have size 1")
            if act.param and len(dims) != 1:
                continue
            if len(dims) != 1:
                raise Unsupported(f"{act.node.name}: carries the units along {len(dims)} axes")
            if (u < 0).any() and not act.param:
                lines = u.movedim(dims[0], -1).reshape(-1, u.shape[dims[0]])
                line = lines[(lines >= 0).any(dim=1).nonzero()[0, 0]]  # one along which the units lie
                span = segment(line)
                if span is None or layout(line[span[0]:span[1]], n) is None:
                    raise Unsupported(f"{act.node.name}: mixes units with other coordinates on the unit axis")
                segments[(act.node, act.index)] = span
            axes[(act.node, act.index)] = dims[0]
        for read in self.rec.shared_reads:  # values the units read alike, repeated to their count
            c = self.cls(read.units)
            if (index[c[c >= 0]] >= 0).any():
                axes.update(repeat_axes(self.lab, read))
        return axes, segments

    def one_coordinate(self, ut: torch.Tensor) -> bool:
        """Every space that gives the unit its coordinates gives it exactly one."""
        spaces = self.spaces_of(ut)
        return bool(spaces) and all(sp.stop - sp.start == 1 for sp in spaces)

    def size_one_dims(self, act: UnitAct) -> list[int]:
        shape = self.lab.shapes.get(act.node)
        if act.index is not None and shape is not None:
            shape = shape[act.index]
        return [d for d, size in enumerate(shape or ()) if size == 1]

    def constants(self, axes: dict[tuple, int], segments: dict[tuple, tuple[int, int]], n: int
                  ) -> tuple[list[ConstantSpec], list[str]]:
        """The count-dependent arguments of every node the units pass through, and the notes of why
        the group needs at least one unit that the op hooks made on the way. A node whose input or output holds
        the units in a segment of the axis is refused if its hook finds constants without reading the segment
        (an offset there would also follow the other coordinates' widths)."""
        consts, notes = [], []
        lab = self.lab
        for node in lab.module.graph.nodes:
            src = node.args[0] if node.args and isinstance(node.args[0], torch.fx.Node) else None
            in_dim = axes.get((src, None)) if src is not None else None
            out_dim = axes.get((node, None))
            if in_dim is None and out_dim is None:
                continue
            site = Site(node=node, in_dim=in_dim, out_dim=out_dim, in_shape=lab.shapes.get(src),
                        out_shape=lab.shapes.get(node), count=n, size_reads=lab.rec.size_reads,
                        values=lab.values, axes=axes, in_ids=getattr(lab.labels.get(src), "ids", None),
                        in_segment=segments.get((src, None)))
            found = RULES.constants_of(site)
            if found and not site.segment_read and (site.in_segment or (node, None) in segments):
                raise Unsupported(f"{node.name}: a size on the unit axis of a value that holds other coordinates "
                                  "beside the units (a fused projection's output); cannot rewrite it")
            consts += found
            notes += site.notes
        return consts, notes


def _varies_among_units(u: torch.Tensor, dim: int) -> bool:
    """Whether the unit ids ``u`` (negative: no unit of the group) change along ``dim`` among the positions that hold
    units: a unit's coordinates beside coordinates of no unit (a shared rotary part after a head's own) lie along
    one axis, the one its units vary along."""
    return varies(torch.where(u >= 0, u, u.amax(dim=dim, keepdim=True)), dim)


def listed(names: list[str], shown: int = 3) -> str:
    """The first ``shown`` of ``names`` and how many more: a reason stays one readable line at any model size."""
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


def _is_sum(node: Node) -> bool:
    """An addition or subtraction (function or method call)."""
    return (node.op == "call_function" and node.target in _SUM_FUNCTIONS) or \
        (node.op == "call_method" and node.target in _SUM_METHODS)


def _sum_read(carriers: set[Node], readers: set[str], mapped: set[str]) -> bool:
    """Whether a sum of ``carriers`` that come from apart reaches a map of ``readers`` (node names) through values made
    of one carrier each (a norm, a view, an activation): a stream the units are summed into and read from. Carriers
    made from one value that no map reads (one projection's output: an attention's output and a convolution of its
    values) sum within the layer: no stream; a value that maps read (``mapped``: node names) is a stream's, however its
    parts are made from it. A product of carriers on the way (the attention's, after a score bias or a rotary
    embedding is summed) ends the search."""
    def one_carrier(node: Node) -> bool:
        return sum(arg in carriers for arg in node.all_input_nodes) == 1

    origins = _origins(carriers)

    def apart(node: Node) -> bool:  # a sum with no carrier among its inputs (of parameters alone) counts as apart
        parts = [origins[arg] for arg in node.all_input_nodes if arg in carriers]
        return not parts or (len(parts) > 1 and all(origin.name in mapped for origin in set.intersection(*parts)))

    todo = [node for node in carriers if _is_sum(node) and apart(node)]
    seen: set[Node] = set()
    while todo:
        node = todo.pop()
        if node.name in readers:
            return True
        if node not in seen:
            seen.add(node)
            todo += [user for user in node.users if user.name in readers or (user in carriers and one_carrier(user))]
    return False


def _origins(carriers: set[Node]) -> dict[Node, set[Node]]:
    """The carriers each carrier is made from that are made from no carrier (the values the units' projections
    make), in one pass in graph order."""
    origins: dict[Node, set[Node]] = {}
    if not carriers:
        return origins
    for node in next(iter(carriers)).graph.nodes:
        if node in carriers:
            made_from = [origins[arg] for arg in node.all_input_nodes if arg in origins]
            origins[node] = set().union(*made_from) if made_from else {node}
    return origins


def _layout(t: torch.Tensor) -> tuple:
    """What decides a tensor's contents among live tensors: its storage, offset, shape, strides and dtype."""
    return t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype


def _units_held(classes_of: list[torch.Tensor], unit_class: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The unit classes each tensor of ``classes_of`` holds, in ascending order: one pass over all of them that drops
    runs of one class, then one sort for the tensors whose unit classes do not already ascend (most do: a
    projection's output lists its coordinates in order)."""
    # a large value's classes often repeat along some dims (a position table's, over its tokens)
    reduced = [compact(c) if c.numel() > _LARGE else c for c in classes_of]
    flat = torch.cat([c.reshape(-1) for c in reduced])
    value = torch.repeat_interleave(torch.arange(len(reduced)), torch.tensor([c.numel() for c in reduced]))
    is_unit = (flat >= 0) & unit_class.index_select(0, flat.clamp(min=0))
    n = len(unit_class)
    key = torch.unique_consecutive((value * n + flat).masked_select(is_unit))  # by value, then position
    value = key // n
    unsorted = torch.zeros(len(reduced), dtype=torch.bool)
    unsorted[value[1:].masked_select(key[1:] < key[:-1])] = True  # the values whose unit classes descend somewhere
    to_sort = unsorted.index_select(0, value)
    held = []  # unit classes of each value, by value then class
    for found in (key.masked_select(~to_sort), torch.unique(key.masked_select(to_sort))):
        held.append(torch.split(found % n, torch.bincount(found // n, minlength=len(reduced)).tolist()))
    return tuple(held[int(sort)][v] for v, sort in enumerate(unsorted.tolist()))


def _group_of_first(group_of: torch.Tensor, units: list[torch.Tensor]) -> tuple[list[int], list[bool]]:
    """For each of the non-empty tensors ``units``: the group of its first unit, and whether all its units lie in that
    group. One gather over the units of all of them (each distinct tensor once: values that share ids share units)."""
    slot: dict[int, int] = {}
    order = [slot.setdefault(id(u), len(slot)) for u in units]
    distinct = list({id(u): u for u in units}.values())
    if not distinct:
        return [], []
    sizes = torch.tensor([len(u) for u in distinct])
    found = group_of.index_select(0, torch.cat(distinct))
    first = found.index_select(0, torch.cumsum(sizes, 0) - sizes)
    part = torch.repeat_interleave(torch.arange(len(distinct)), sizes)
    stray = (found != first.index_select(0, part)).long()
    strays = torch.zeros(len(distinct), dtype=torch.long).index_add_(0, part, stray)
    first, alone = first.tolist(), (strays == 0).tolist()
    return [first[k] for k in order], [alone[k] for k in order]


def _first_appearance(axes: list[torch.Tensor], bound: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The unit classes of ``axes`` (each value's unit classes, below ``bound``; values in order) in order of first
    appearance, and the edges that chain each value's classes, as positions in that order. The first appearances
    are marked by a table over the classes, so no sort is needed."""
    if not axes:
        return torch.empty(0, dtype=torch.long), torch.empty(0, 2, dtype=torch.long)
    seq = torch.cat(axes)
    value = torch.repeat_interleave(torch.arange(len(axes)), torch.tensor([len(a) for a in axes]))
    at = torch.arange(len(seq))
    # the position where each element's class first appears
    first = torch.full((bound,), len(seq)).scatter_reduce_(0, seq, at, "amin").index_select(0, seq)
    is_first = first == at
    chained, same_value = (torch.cumsum(is_first, 0) - 1).index_select(0, first), value[1:] == value[:-1]
    edges = torch.stack([chained[:-1].masked_select(same_value), chained[1:].masked_select(same_value)], dim=1)
    return seq.masked_select(is_first), edges


def _components(units: torch.Tensor, rep: torch.Tensor, bound: int) -> list[torch.Tensor]:
    """``units`` (classes below ``bound``) grouped by their component representatives ``rep`` (each the first
    position of its component): components in order of first appearance, each one's classes sorted."""
    if not len(units):
        return []
    order = torch.argsort(rep * bound + units)
    _, sizes = torch.unique_consecutive(rep[order], return_counts=True)
    return list(torch.split(units[order], sizes.tolist()))


def group_graph(lab: Labeller, locate: bool = False, *, returns_units: bool = False) -> GraphGroups:
    """Group specs and refusals of a graph that ``lab`` has run; with ``locate``, only where the
    candidate groups are; with ``returns_units``, channels the graph returns may be units (see ``_Builder``)."""
    return _Builder(lab, returns_units).build(locate)
