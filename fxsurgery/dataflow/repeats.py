"""Calls that repeat an earlier call node for node: the blocks of a deep model, built alike and run one after the
other. Labelling a later call whose inputs carry the labels the first call's carried records what labelling the first
recorded, with the first's new ids moved to new ones of its own, its nodes and paths to the later call's: the
``Labeller`` replays those records (``Translation``) instead of running the rules again.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, NamedTuple

import torch
import torch.fx
import torch.nn as nn
from torch.fx.node import Node

from .ids import broadcast_base
from .paths import within
from .records import Records, Space


class Call(NamedTuple):
    """One call of a module in a graph: its module path, its nodes in graph order, the nodes outside it that they read
    (in the order first read) and its nodes read outside it."""

    module: str
    nodes: list[Node]
    inputs: list[Node]
    outputs: list[Node]


class Repeat(NamedTuple):
    """A call (``later``) that repeats an earlier one (``first``), node for node."""

    first: Call
    later: Call

    def renamed(self, path: str) -> str:
        """``path`` inside the first call's module as the same path inside the later call's."""
        return self.later.module + path[len(self.first.module):]


MIN_NODES = 8  # a shorter call costs less to label than to compare


def find_repeats(gm: torch.fx.GraphModule) -> dict[Node, Repeat]:
    """Calls of ``gm`` that repeat the first call of a module of their class (the outermost such calls, of at least
    ``MIN_NODES`` nodes), keyed by their first node."""
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    calls = [(module, cls, nodes) for module, (cls, nodes) in _calls(gm.graph).items()
             if module and len(nodes) >= MIN_NODES]
    found: dict[Node, Repeat] = {}
    claimed: set[Node] = set()
    firsts: dict[str, Call] = {}  # class -> the first call of a module of that class
    kinds: dict[str, tuple] = {}  # what each read module or tensor is made of
    for module, cls, nodes in sorted(calls, key=lambda c: (c[0].count("."), position[c[2][0]])):
        if nodes[0] in claimed:
            continue
        call = _call(module, nodes)
        first = firsts.setdefault(cls, call)
        if first is call or position[first.nodes[-1]] >= position[nodes[0]] or within(module, first.module):
            continue
        if _same_calls(gm, first, call, kinds):
            found[call.nodes[0]] = Repeat(first, call)
            claimed.update(call.nodes)
    return found


def _calls(graph: torch.fx.Graph) -> dict[str, tuple[str, list[Node]]]:
    """Each module called in the graph (by its nodes' module stacks) with its class and nodes, where they are one
    run of consecutive nodes."""
    runs: dict[str, tuple[str, list[Node]]] = {}
    last: dict[str, int] = {}
    broken: set[str] = set()
    for i, node in enumerate(graph.nodes):
        for path, cls in node.meta.get("nn_module_stack", {}).values():
            if path in last and last[path] != i - 1:
                broken.add(path)
            last[path] = i
            runs.setdefault(path, (str(cls), []))[1].append(node)
    return {path: run for path, run in runs.items() if path not in broken}


def _call(module: str, nodes: list[Node]) -> Call:
    inside = set(nodes)
    inputs = list(dict.fromkeys(a for n in nodes for a in n.all_input_nodes if a not in inside))
    outputs = [n for n in nodes if any(u not in inside for u in n.users)]
    return Call(module, nodes, inputs, outputs)


def _same_calls(gm: torch.fx.GraphModule, first: Call, later: Call, kinds: dict[str, tuple]) -> bool:
    """The later call runs the same ops on the same kind of modules and tensors, reading its inputs and its own nodes
    where the first reads its own."""
    if len(first.nodes) != len(later.nodes) or len(first.inputs) != len(later.inputs) \
            or len(first.outputs) != len(later.outputs):
        return False
    repeat = Repeat(first, later)
    pairs = dict(zip(first.nodes, later.nodes)) | dict(zip(first.inputs, later.inputs))
    for a, b in zip(first.nodes, later.nodes):
        if a.op != b.op or (b in later.outputs) != (a in first.outputs):
            return False
        if a.op in ("call_module", "get_attr"):
            if not within(a.target, first.module) or repeat.renamed(a.target) != b.target \
                    or _kind(gm, a.op, a.target, kinds) != _kind(gm, b.op, b.target, kinds):
                return False
        elif a.target != b.target:
            return False
        if not _same_arguments((a.args, a.kwargs), (b.args, b.kwargs), pairs):
            return False
    return True


def _same_arguments(a: Any, b: Any, pairs: dict[Node, Node]) -> bool:
    if isinstance(a, Node):
        return isinstance(b, Node) and pairs.get(a) is b
    if type(a) is not type(b):
        return False
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same_arguments(x, y, pairs) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_arguments(a[k], b[k], pairs) for k in a)
    if isinstance(a, slice):
        return _same_arguments((a.start, a.stop, a.step), (b.start, b.stop, b.step), pairs)
    if isinstance(a, torch.Tensor):
        return a is b
    return a == b


def _kind(gm: torch.fx.GraphModule, op: str, target: str, kinds: dict[str, tuple]) -> tuple:
    """What a read module or tensor is made of (each module's class and plain attributes, and the shapes and dtypes
    of its tensors), worked out once per target."""
    if target not in kinds:
        kinds[target] = _made_of(gm, op, target)
    return kinds[target]


def _made_of(gm: torch.fx.GraphModule, op: str, target: str) -> tuple:
    found = gm.get_submodule(target) if op == "call_module" else _attribute(gm, target)
    if not isinstance(found, nn.Module):
        return (type(found), tuple(found.shape), found.dtype) if torch.is_tensor(found) else (type(found), repr(found))
    return tuple((type(m), tuple(sorted((k, repr(v)) for k, v in vars(m).items()
                                        if not k.startswith("_") and not isinstance(v, (torch.Tensor, nn.Module)))),
                  tuple((k, tuple(t.shape), t.dtype) for k, t in [*m.named_parameters(recurse=False),
                                                                 *m.named_buffers(recurse=False)] if t is not None))
                 for _, m in found.named_modules())


def _attribute(gm: torch.fx.GraphModule, target: str) -> Any:
    owner, _, name = target.rpartition(".")
    return getattr(gm.get_submodule(owner), name)


LISTS = tuple(f.name for f in dataclasses.fields(Records) if f.name not in ("next_id", "size_reads"))


class Span(NamedTuple):
    """What labelling a call recorded: the length of each of the records' lists before and after it, the ids it
    handed out (``first_id`` up to ``end_id``) and the nodes whose sizes it read."""

    before: tuple[int, ...]
    after: tuple[int, ...]
    first_id: int
    end_id: int
    size_reads: frozenset[Node]


def lengths(rec: Records) -> tuple[int, ...]:
    return tuple(len(getattr(rec, name)) for name in LISTS)


class Untranslatable(Exception):
    """A record that names a node of the first call where its name cannot be told from a word."""


_TOKEN = re.compile(r"[\w.]+")


Builder = Callable[["Translation"], Any]  # a template's record (or a part of it), built for a later call


class Template:
    """A labelled call's records and its nodes' labels, each kept as how to build it for a later call (``Builder``;
    a part with nothing to translate is kept as it is), with their id tensors set aside as one flat tensor: moving the
    call's new ids (``low`` on) for a later call is then one operation, whatever the number of records."""

    def __init__(self, records: dict[str, list], labels: list, low: int):
        self.low = low
        self.tensors: list[torch.Tensor] = []
        self._slots: dict[tuple, int] = {}  # tensors that share one id tensor share its slot
        self.records = {name: [self._builder(r) for r in found] for name, found in records.items()}
        self.labels = [self._builder(label) for label in labels]
        bases = [broadcast_base(t) for t in self.tensors]  # moving ids need not copy repeats
        flat = torch.cat([b.reshape(-1) for b in bases] + [torch.empty(0, dtype=torch.long)])
        self._sizes = [b.numel() for b in bases]
        self._shapes = [(tuple(b.shape), tuple(t.shape)) for b, t in zip(bases, self.tensors)]
        self._new = (flat >= low).long()
        self._flat = flat
        self._moves = [bool(part.any()) for part in torch.split(self._new, self._sizes)]

    def _builder(self, r: Any) -> Builder:
        """How to build the record or label ``r`` for a later call (itself, where nothing in it changes)."""
        part = self._part(r)
        return (lambda translation: r) if part is None else part

    def _part(self, r: Any, field: str | None = None) -> Builder | None:
        """How to build ``r`` for a later call, or None where it is the same for every call. ``field``: the name of
        the record's field that holds ``r`` (a string there is a text or a name, anywhere else it is kept)."""
        if isinstance(r, torch.Tensor):
            key = (r.untyped_storage().data_ptr(), r.storage_offset(), tuple(r.shape), r.stride(), r.dtype)
            index = self._slots.setdefault(key, len(self.tensors))
            if index == len(self.tensors):
                self.tensors.append(r)
            return lambda translation: translation.tensors[index]
        if isinstance(r, Node):
            return lambda translation: translation.nodes.get(r, r)
        if isinstance(r, Space):
            return lambda translation: Space(r.start + translation.shift, r.stop + translation.shift,
                                             translation.name(r.node))
        if isinstance(r, str) and field is not None:
            return (lambda translation: translation.text(r)) if field in _TEXTS else \
                (lambda translation: translation.name(r))
        if isinstance(r, tuple) and hasattr(r, "_fields"):
            return _rebuilt(lambda values: type(r)(*values), r, [self._part(v, k) for k, v in zip(r._fields, r)])
        if isinstance(r, tuple):
            return _rebuilt(tuple, r, [self._part(v) for v in r])
        if dataclasses.is_dataclass(r):
            names = [f.name for f in dataclasses.fields(r)]
            values = [getattr(r, name) for name in names]
            return _rebuilt(lambda built: dataclasses.replace(r, **dict(zip(names, built))), values,
                            [self._part(v) for v in values])
        return None

    def moved(self, shift: int) -> list[torch.Tensor]:
        """The id tensors with the new ids moved by ``shift`` (those without new ids as they are)."""
        parts = torch.split(self._flat + self._new * shift, self._sizes)
        return [part.view(base).expand(shape) if moves else t
                for part, (base, shape), moves, t in zip(parts, self._shapes, self._moves, self.tensors)]


def _rebuilt(make: Callable[[list], Any], values: Any, parts: list[Builder | None]) -> Builder | None:
    """Build a record from its ``values``, those with a builder in ``parts`` built; None where none has one."""
    if all(part is None for part in parts):
        return None
    pairs = list(zip(values, parts))
    return lambda translation: make([v if part is None else part(translation) for v, part in pairs])


class Translation:
    """From a template of the first call's records to the later call's: the first's new ids moved to ``next_id``
    on, its nodes and their names to the later call's matching ones, module paths inside its module to the later
    module's."""

    def __init__(self, repeat: Repeat, template: Template, next_id: int):
        self.repeat, self.shift = repeat, next_id - template.low
        self.nodes = dict(zip(repeat.first.nodes, repeat.later.nodes)) | dict(zip(repeat.first.inputs,
                                                                                repeat.later.inputs))
        self.names = {a.name: b.name for a, b in self.nodes.items()}
        self.tensors = template.moved(self.shift)

    def record(self, built: Builder) -> Any:
        """A record of a template (a NamedTuple of ids, nodes, names and texts), a node or a label, translated."""
        return built(self)

    def name(self, name: str) -> str:
        """A node's name, or a path of a module, parameter or buffer."""
        if name in self.names:
            return self.names[name]
        return self.repeat.renamed(name) if within(name, self.repeat.first.module) else name

    def text(self, text: str) -> str:
        """A reason: a node name of the call (leading it, ``"add_3: ..."``, or with a digit or an underscore, as no
        word has) becomes the later call's, a path inside the call's module the later one's. Another node name
        (``linear``), or a path of a module named by a number (which a number in the text could be), cannot be told
        from a word."""
        first = self.repeat.first.module

        def swap(match: re.Match) -> str:
            token = match.group(0).rstrip(".")  # a full stop ends a sentence, not a path
            stop = match.start() + len(token)
            if token in self.names:
                leading = not match.start() and text[stop:stop + 1] in ("", ":")
                if not leading and not any(c.isdigit() or c == "_" for c in token):  # "linear": a name or a word
                    raise Untranslatable(token)
                token = self.names[token]
            elif within(token, first):
                if not first[:1].isalpha() and first[:1] != "_":
                    raise Untranslatable(token)
                token = self.name(token)
            return token + match.group(0)[stop - match.start():]
        return _TOKEN.sub(swap, text)


_TEXTS = ("reason", "text")  # the fields of the records that hold free text (the others that hold strings: names)
