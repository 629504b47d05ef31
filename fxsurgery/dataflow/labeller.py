"""Dataflow labelling: run a traced graph on real inputs and, beside every value, an id tensor that
says which feature coordinates (rows of the Linear that produced them) each position carries.

Ops tie coordinates together (an elementwise op of two activations, a contraction of two activations,
a parameter shared by a coordinate), couple them for exactness (normalisations), or make them
unsliceable (an op without a rule). ``Records`` keeps all of it for the grouping step. Op handling
is the table in ``fxsurgery.dataflow.rules``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Protocol

import torch
import torch.fx
from torch.fx.node import Node, map_arg

from ..capture.calls import meta_state
from ..capture.meta_memo import MetaMemo
from ..compat import running_node, tree_leaves, tree_map
from ..errors import AnalysisError
from .ids import broadcast_base
from .records import Act, Records
from .repeats import LISTS, Repeat, Span, Template, Translation, Untranslatable, lengths


class Rules(Protocol):
    """What the labeller asks of its op table (``rule_table.RuleTable``, whose rules take a ``Step`` of this
    module): the label of each node's value."""

    def label(self, s: Step) -> Any: ...


@dataclass(frozen=True)
class Label:
    """Ids beside one tensor value. ``param`` is True while the value derives only from parameters or
    buffers (its ids are the elements' own ids, not feature coordinates)."""

    ids: torch.Tensor
    param: bool = False


def _is_meta(t: Any) -> bool:
    return torch.is_tensor(t) and t.is_meta


def _reads_metadata(n: Node) -> bool:
    """A read of a tensor's shape, device or dtype (not of its values)."""
    if n.op == "call_function" and n.target is getattr:
        return n.args[1] in ("shape", "device", "dtype", "ndim")
    return n.op == "call_method" and n.target in ("size", "dim")


_PLAIN = (int, float, bool, str, type(None), slice, torch.dtype, torch.device)


def to_meta(x: Any) -> Any:
    """``x`` with every tensor in it on the meta device (``x`` itself when it holds none off it)."""
    return tree_map(lambda t: t.to("meta") if torch.is_tensor(t) else t, x) if _may_hold_real(x) else x


def _may_hold_real(x: Any) -> bool:
    """Whether ``x`` may hold a tensor off the meta device (True for containers this does not look into)."""
    if isinstance(x, torch.Tensor):
        return not x.is_meta
    if isinstance(x, (tuple, list)):
        return any(_may_hold_real(v) for v in x)
    if isinstance(x, dict):
        return any(_may_hold_real(v) for v in x.values())
    return not isinstance(x, _PLAIN)


class Labeller(torch.fx.Interpreter):
    """Interpreter whose one job is to compute a ``Label`` beside every value of the graph.

    With ``meta``, values that depend on the graph inputs are computed on the meta device (shapes
    only, no arithmetic); values made from parameters and buffers alone (index tables, masks) are
    computed for real, since rules read them.

    Given ``repeats`` (``repeats.find_repeats``, on meta values), a later call whose inputs carry what the first
    call's did is not run: what labelling the first recorded is replayed for it (``replayed`` lists those calls)."""

    def __init__(self, gm: torch.fx.GraphModule, rules: Rules, rec: Records | None = None,
                 seeds: dict[str, Any] | None = None, meta: bool = True, repeats: dict[Node, Repeat] | None = None):
        super().__init__(gm, garbage_collect_values=True)
        self.rules = rules
        self.rec = rec if rec is not None else Records()
        self.seeds = seeds  # set when labelling the inside of an opaque function: its inputs' labels
        self.meta = meta
        self.memo = MetaMemo()  # blocks built alike: their shapes are worked out once
        self.dynamic: set[Node] = set()  # nodes whose values depend on the inputs
        self.labels: dict[Node, Any] = {}
        self.shapes: dict[Node, Any] = {}
        self.dtypes: dict[Node, Any] = {}  # beside ``shapes``: what a value is made of, to re-run a node on meta
        self.strides: dict[Node, Any] = {}  # beside ``shapes``: how a value is laid out, to make it again on meta
        self.values: dict[Node, Any] = {}  # non-tensor values (ints, sizes), for constants
        self.repeats = repeats if meta and repeats else {}
        self.replayed: list[Repeat] = []
        self._sources: dict[str, list[Any]] = {}  # a first call's module -> the calls alike labelled in full
        calls = {c.module: c for r in self.repeats.values() for c in r}
        self._starts = {call.nodes[0]: call for call in calls.values()}
        self._ends = {call.nodes[-1]: call for call in calls.values()}
        self._before: dict[str, tuple] = {}  # a call's module -> the records' state before it was labelled
        self._spans: dict[str, tuple[Span, tuple]] = {}  # -> what labelling it recorded, and its surroundings
        self._replaying: dict[Node, Any] = {}  # the values of the nodes of a call being replayed
        self._templates: dict[str, Template] = {}  # a labelled call's module -> its records, ready to replay
        self._told_so_far = [(0, torch.zeros(1, dtype=torch.bool)) for _ in _TOLD]  # see ``_told``

    def run_node(self, n: Node) -> Any:
        if n in self.repeats:
            self._replay(self.repeats[n])  # its nodes' values wait in ``_replaying``, or it is labelled below
        if n in self._replaying:
            return self._replaying.pop(n)
        if n in self._starts:
            call = self._starts[n]
            self._before[call.module] = (lengths(self.rec), self.rec.next_id, set(self.rec.size_reads),
                                         self._surroundings(call))
        out = self._run_and_label(n)
        if n in self._ends and self._ends[n].module in self._before:
            call = self._ends[n]
            before, first_id, size_reads, surroundings = self._before.pop(call.module)
            self._spans[call.module] = (Span(before, lengths(self.rec), first_id, self.rec.next_id,
                                             frozenset(self.rec.size_reads - size_reads)), surroundings)
        return out

    def _run_and_label(self, n: Node) -> Any:
        if (n.op == "placeholder" and not self.nested) or any(a in self.dynamic for a in n.all_input_nodes):
            self.dynamic.add(n)
        if self.meta and n in self.dynamic:
            with running_node(self, n), self.memo:
                args, kwargs = to_meta(self.fetch_args_kwargs_from_env(n))
                out = getattr(self, n.op)(n.target, args, kwargs)
        else:
            out = super().run_node(n)
        if n.op == "placeholder" and self.nested and any(_is_meta(t) for t in tree_leaves(out)):
            self.dynamic.add(n)  # the caller's value depends on its inputs
        if n in self.dynamic and _reads_metadata(n):  # known exactly on the meta device: index tables built
            self.dynamic.discard(n)                    # from sizes on x.device are computed for real
            out = torch.device("cpu") if isinstance(out, torch.device) and out.type == "meta" else out
        if torch.is_tensor(out):
            self.shapes[n], self.dtypes[n], self.strides[n] = tuple(out.shape), out.dtype, out.stride()
        elif isinstance(out, (tuple, list)) and out and all(torch.is_tensor(o) for o in out):
            self.shapes[n] = tuple(tuple(o.shape) for o in out)
            self.dtypes[n] = tuple(o.dtype for o in out)
            self.strides[n] = tuple(o.stride() for o in out)
        elif out is None or isinstance(out, (int, float, bool, torch.Size, tuple, list, torch.device, torch.dtype)):
            self.values[n] = out
        label = self._label(Step(self, n, out))
        self.labels[n] = label
        self._record_acts(n, label)
        return out

    def _replay(self, repeat: Repeat) -> None:
        """Replay for ``repeat``'s later call the records of a call alike labelled before it, where they are what
        labelling it would record: that call was labelled whole, only from its inputs (nothing computed for real from
        parameters or buffers alone, whose values rules may read), and the later call's inputs, and what the records
        say of them, match that call's as they stood then. A later call labelled in full serves the ones after it."""
        later = repeat.later
        sources = self._sources.setdefault(repeat.first.module, [repeat.first])
        surroundings = self._surroundings(later)
        for source in reversed(sources):
            if source.module in self._spans and self._spans[source.module][1] == surroundings \
                    and self._replayable(source):
                if self._replay_from(Repeat(source, later)):
                    return
                del self._spans[source.module]  # its records name its nodes as words: no later call replays them
        sources.append(later)

    def _replay_from(self, repeat: Repeat) -> bool:
        """Append the translated records of ``repeat.first`` for ``repeat.later`` and give the later call's nodes
        their labels and values; False (nothing changed) where a record cannot be translated."""
        first, later = repeat
        span = self._spans[first.module][0]
        if first.module not in self._templates:
            records = {name: getattr(self.rec, name)[start:stop]
                       for name, start, stop in zip(LISTS, span.before, span.after)}
            self._templates[first.module] = Template(records, [self.labels[a] for a in first.nodes], span.first_id)
        template = self._templates[first.module]
        translation = Translation(repeat, template, self.rec.next_id)
        try:
            added = {name: [translation.record(r) for r in records] for name, records in template.records.items()}
            labels = {b: translation.record(label) for b, label in zip(later.nodes, template.labels)}
        except Untranslatable:
            return False
        for name, records in added.items():
            getattr(self.rec, name).extend(records)
        self.rec.size_reads |= {translation.nodes[a] for a in span.size_reads}
        self.rec.next_id += span.end_id - span.first_id
        self.replayed.append(repeat)
        self._replaying = dict.fromkeys(later.nodes)
        for a, b in zip(first.nodes, later.nodes):
            self.labels[b] = labels[b]
            for table in (self.shapes, self.dtypes, self.strides, self.values):
                if a in table:
                    table[b] = table[a]
            if a in self.dynamic:
                self.dynamic.add(b)
        for a, b in zip(first.outputs, later.outputs):
            self._replaying[b] = self.values[a] if a in self.values else \
                torch.empty(self.shapes[a], dtype=self.dtypes[a], device="meta")
        return True

    def _replayable(self, call: Any) -> bool:
        """Every node of ``call`` was labelled, none computed for real from a parameter or buffer (a later call's
        may hold other values), and each output is one tensor or a plain value."""
        from_state: set[Node] = set()
        for a in call.nodes:
            if a not in self.labels:
                return False
            if a.op == "get_attr":
                from_state.add(a)
            elif a not in self.dynamic and any(i in from_state for i in a.all_input_nodes):
                return False
        return all(a in self.values or (isinstance(self.shapes.get(a), tuple)
                                        and all(isinstance(d, int) for d in self.shapes[a])) for a in call.outputs)

    def _surroundings(self, call: Any) -> tuple:
        """What labelling ``call`` reads from outside it: its inputs' labels, shapes, dtypes and plain values, and
        what the records say of them (sizes read; ids in products, applied or contracted)."""
        def ids_of(label: Any) -> list[torch.Tensor]:
            return [lab.ids for lab in (label if isinstance(label, tuple) else (label,)) if isinstance(lab, Label)]
        told = self._told()
        rows = []
        for a in call.inputs:
            label = self.labels.get(a)
            ids = ids_of(label)
            rows.append((_label_key(label), self.shapes.get(a), self.dtypes.get(a), _plain_key(self.values, a),
                         a in self.dynamic, a in self.rec.size_reads,
                         tuple(bool(known[broadcast_base(t) + 1].any()) for t in ids for known in told)))
        return tuple(rows)

    def _told(self) -> list[torch.Tensor]:
        """Which ids the products, applied and contracted records so far hold: per list, a flag at ``1 + id`` (0 for
        ``NO_ID``). The lists are only ever appended to: a new record's ids are added to the flags, which grow by
        doubling."""
        for k, name in enumerate(_TOLD):
            found = getattr(self.rec, name)
            have, flags = self._told_so_far[k]
            if len(flags) <= self.rec.next_id:
                flags = torch.cat([flags, torch.zeros(max(self.rec.next_id + 1, len(flags)), dtype=torch.bool)])
            for ids in found[have:]:
                flags[broadcast_base(ids) + 1] = True
            self._told_so_far[k] = (len(found), flags)
        return [flags for _, flags in self._told_so_far]

    def _label(self, step: Step) -> Any:
        """The node's label from its rule. A rule that fails refuses what reaches the node, naming it and the
        error, so the rest of the graph is still analysed; on meta values the failure is raised instead (the
        caller labels again on real ones), and with no ids reaching the node there is nothing to refuse but the
        graph."""
        try:
            return self.rules.label(step)
        except Exception as e:
            if self.meta:
                raise
            first_line = str(e).splitlines()[0] if str(e) else ""
            reason = f"{step.name}: its rule failed: {type(e).__name__}: {first_line}"
            labelled = [lab for _, lab in step.tensors() if lab is not None]
            if not labelled:
                raise AnalysisError(reason) from e
            for lab in labelled:
                self.rec.pin(lab.ids, reason)
            return None

    def placeholder(self, target: Any, args: Any, kwargs: Any) -> Any:
        out = super().placeholder(target, args, kwargs)
        return to_meta(out) if self.meta and not self.nested else out  # a caller's values are already decided

    def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
        if not self.meta or not any(_is_meta(t) for t in tree_leaves((args, kwargs))):
            return super().call_module(target, args, kwargs)
        mod = self.fetch_attr(target)
        state = meta_state(mod)
        if not state:  # nothing to swap for meta tensors (a dropout, an activation): a plain call
            return super().call_module(target, args, kwargs)
        return torch.func.functional_call(mod, state, args, kwargs)

    def label_of(self, n: Node) -> Any:
        """The label of ``n``'s value; an empty tensor (a layer left with no units) carries no coordinates."""
        value = self.env.get(n)
        return None if torch.is_tensor(value) and value.numel() == 0 else self.labels.get(n)

    @property
    def nested(self) -> bool:
        return self.seeds is not None

    def _record_acts(self, n: Node, label: Any) -> None:
        if self.nested or n.op == "get_attr":  # raw parameters are members, not values with constants
            return
        if isinstance(label, Label):
            self.rec.acts.append(Act(n, None, label.ids, label.param))
        elif isinstance(label, tuple):
            for i, lab in enumerate(label):
                if isinstance(lab, Label):
                    self.rec.acts.append(Act(n, i, lab.ids, lab.param))


_TOLD = ("products", "applied", "contracted")  # the records whose ids a later call's labelling reads


def _label_key(label: Any) -> Any:
    """A label as a comparable value: its ids' shape and contents (those of the dims it does not broadcast: equal keys
    are equal ids), and whether it is a parameter's."""
    if isinstance(label, Label):
        base = broadcast_base(label.ids)
        return tuple(label.ids.shape), tuple(base.shape), base.contiguous().numpy().tobytes(), base.dtype, label.param
    if isinstance(label, tuple):
        return tuple(_label_key(lab) for lab in label)
    return label


def _plain_key(values: dict[Node, Any], node: Node) -> Any:
    """A node's plain value as a comparable one (a tensor in it stands for itself); absent for tensor values."""
    if node not in values:
        return "absent"
    return tuple((type(v), id(v)) if torch.is_tensor(v) else (type(v), v) for v in tree_leaves(values[node]))


class Step:
    """One node being labelled: its real argument values, their labels, and the output value."""

    def __init__(self, lab: Labeller, node: Node, out: Any):
        self.lab, self.rec, self.node, self.out = lab, lab.rec, node, out
        env = lab.env
        self.args = map_arg(node.args, lambda a: env.get(a))
        self.kwargs = map_arg(node.kwargs, lambda a: env.get(a))
        self.largs = map_arg(node.args, lambda a: lab.label_of(a))
        self.lkwargs = map_arg(node.kwargs, lambda a: lab.label_of(a))

    @property
    def name(self) -> str:
        return self.node.name

    def arg(self, i: int, key: str, default: Any = None) -> tuple[Any, Any]:
        """(value, label) of positional argument ``i`` or keyword ``key``."""
        if i < len(self.node.args):
            return self.args[i], self._label_at(self.node.args[i], self.largs[i])
        if key in self.node.kwargs:
            return self.kwargs[key], self._label_at(self.node.kwargs[key], self.lkwargs[key])
        return default, None

    @staticmethod
    def _label_at(raw: Any, label: Any) -> Any:
        return label if isinstance(raw, Node) else None

    def tensors(self) -> Iterator[tuple[torch.Tensor, Label | None]]:
        """Every tensor argument (nested in lists too) with its label."""
        vals, labs = [], []
        _flatten((self.node.args, self.node.kwargs), (self.args, self.kwargs), (self.largs, self.lkwargs), vals, labs)
        for v, lab in zip(vals, labs):
            if torch.is_tensor(v):
                yield v, lab if isinstance(lab, Label) else None

    def node_of(self, value: Any) -> Node | None:
        """The argument node whose value is ``value`` (the object itself), at the top level or in a list."""
        nodes = [a for a in self.node.all_input_nodes if self.lab.env.get(a) is value]
        return nodes[0] if nodes else None

    def has_labels(self) -> bool:
        return any(lab is not None for _, lab in self.tensors())


def _flatten(raw: Any, val: Any, lab: Any, vals: list, labs: list) -> None:
    if isinstance(raw, Node):
        vals.append(val)
        labs.append(lab)
    elif isinstance(raw, (tuple, list)):
        for raw_item, val_item, lab_item in zip(raw, val, lab):
            _flatten(raw_item, val_item, lab_item, vals, labs)
    elif isinstance(raw, dict):
        for k in raw:
            _flatten(raw[k], val[k], lab[k], vals, labs)
