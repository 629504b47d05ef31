"""Where the one head of a single-head layer lies. With one unit, unit ids vary along no dim, so the head axis is
told from the graph: a reshape that splits the head's coordinates into a block with one size-1 dim starts it;
widening follows it (per-head tensors too); the reshapes between the merged and the split forms tell the
``[outer][unit][inner]`` layout of the projections' rows and columns. What cannot be told is refused, by node."""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch.fx.node import Node

from ..slicing import ParamSlice
from .constants import Unsupported
from .ids import align, reshape_blocks
from .records import Sink
from .widening import Key, Widened, widen

_RESHAPE_METHODS = {"view", "reshape", "unflatten", "flatten"}
_RESHAPE_FUNCTIONS = {torch.reshape, torch.unflatten, torch.flatten}


class HeadAct(NamedTuple):
    """A value carrying the head: its raw ids (feature coordinates) and whether it derives from parameters only."""

    node: Node
    index: int | None
    ids: torch.Tensor
    param: bool


class Junction(NamedTuple):
    """A reshape between the merged form (coordinates on one dim) and the split form (a size-1 head axis)."""

    merged: torch.Tensor  # the merged side's ids, in order
    inner: int  # coordinates after the head axis on the split side
    split: bool  # True where it splits (rows of a projection), False where it merges (the output's columns)


def _is_reshape(node: Node) -> bool:
    return (node.op == "call_method" and node.target in _RESHAPE_METHODS) or \
        (node.op == "call_function" and node.target in _RESHAPE_FUNCTIONS)


def _coordinate_dims(ids: torch.Tensor, rank: int) -> list[int]:
    ids = align(ids, rank)
    return [d for d in range(rank) if ids.shape[d] > 1]


class SingleHead:
    """The axes of every value of a one-head group and the slices of its members."""

    def __init__(self, lab, acts: list[HeadAct]):
        self.lab = lab
        self.acts = {(a.node, a.index): a for a in acts}
        self.values = [a for a in acts if not a.param]
        self.value_nodes = {a.node for a in self.values}
        self.junctions: list[Junction] = []
        self.splits, self.ambiguous = self.split_seeds()
        self.seeds = dict(self.splits)
        self.merged: dict[Node, int] = {}  # reshapes with literal sizes that merge the head back: their output dim
        for _ in range(len(self.values)):  # a reshape with the head count as a literal starts the axis anew
            self.base = self.widen(self.seeds)
            stopped = [*self.base.failures, *self.astray(self.base)]
            again = {node: dim for node, dim in map(self.passed, stopped) if dim is not None}
            self.merged.update({n: d for n, d in again.items() if self.lab.shapes[n][d] > 1})
            again = {n: d for n, d in again.items() if n not in self.merged and n not in self.seeds}
            if not again:
                break
            self.seeds.update(again)

    def widen(self, seeds: dict[Node, int]) -> Widened:
        lab = self.lab
        return widen(lab.module, lab.shapes, lab.dtypes, lab.values, seeds)

    def shape(self, key: Key) -> tuple:
        shape = self.lab.shapes[key[0]]
        return shape[key[1]] if key[1] is not None else shape

    def split_seeds(self) -> tuple[dict[Node, int], dict[Node, str]]:
        """Reshapes whose input holds the head's coordinates on one dim and whose output splits that dim into
        a block with exactly one size-1 dim: the head axis starts there."""
        seeds, ambiguous = {}, {}
        for act in self.values:
            node = act.node
            src = node.args[0] if node.args else None
            if act.index is not None or not _is_reshape(node) or (src, None) not in self.acts:
                continue
            in_shape, out_shape = self.lab.shapes[src], self.lab.shapes[node]
            dims = _coordinate_dims(self.acts[(src, None)].ids, len(in_shape))
            if len(dims) != 1:
                continue
            ones = _split_ones(in_shape, out_shape, dims[0])
            if len(ones) == 1:
                seeds[node] = ones[0]
            elif ones:
                ambiguous[node] = (f"{node.name}: splits the head's coordinates into {tuple(out_shape)}, whose "
                                   f"dims {ones} all have size 1: which one is the head axis cannot be told")
        return seeds, ambiguous

    def astray(self, run: Widened) -> list[Node]:
        """Reshapes the widened head passed into another block than its own (a ``-1`` took its wide size:
        ``x.reshape(b, n, 1, -1, 2)``): their head axis is the one ``passed`` tells, as for literal sizes."""
        astray = []
        for (node, index), dim in run.axes.items():
            src = node.args[0] if node.args else None
            if index is None and _is_reshape(node) and (src, None) in run.axes:
                _, outs = _block_of(self.lab.shapes[src], self.lab.shapes[node], in_dim=run.axes[(src, None)])
                astray += [node] if dim not in outs else []
        return astray

    def passed(self, node: Node) -> tuple[Node, int | None]:
        """Where a reshape that the widened head cannot pass (its sizes are literals) puts the head: the output dim
        of the reshape block that holds the input's head axis."""
        src = node.args[0] if node.args else None
        if not _is_reshape(node) or (src, None) not in self.base.axes:
            return node, None
        _, outs = _block_of(self.lab.shapes[src], self.lab.shapes[node], in_dim=self.base.axes[(src, None)])
        return node, (outs[0] if len(outs) == 1 else None)

    def axes(self, extra: dict[Node, int]) -> dict[Key, int]:
        """The head axis of every value of the group (per-head tensors seeded at ``extra``), or Unsupported."""
        run = self.widen({**self.seeds, **extra}) if extra else self.base
        carried = {k[0] for k in run.axes}
        axes: dict[Key, int] = {}
        merged: set[Node] = set()  # nodes whose values hold the head's coordinates on one dim, unsplit
        self.junctions = []
        for act in self.values:
            key, node = (act.node, act.index), act.node
            dims = _coordinate_dims(act.ids, len(self.shape(key)))
            src = node.args[0] if node.args else None
            if node in self.merged and (src, None) in run.axes:
                axes[key] = self.merged[node]
            elif key in run.axes:
                axes[key] = run.axes[key]
            elif not any(a in carried for a in node.all_input_nodes) and node not in self.ambiguous \
                    and self.unsplit(act, dims, merged, axes) is not None:
                axes[key] = self.unsplit(act, dims, merged, axes)
                merged.add(node)
                continue
            else:
                raise Unsupported(self.ambiguous.get(node) or run.failures.get(node) or next(
                    (run.failures[a] for a in node.all_input_nodes if a in run.failures),
                    f"{node.name}: no dim of it can be told to hold the head (one head: no size-1 dim split off "
                    "its coordinates reaches it)"))
            if node in self.splits:
                out = self.shape(key)
                _, outs = _block_of(self.lab.shapes[src], out, out_dim=axes[key])
                inner = _product(out[j] for j in outs if j > axes[key])
                self.junctions.append(Junction(self.acts[(src, None)].ids.flatten(), inner, True))
            elif _is_reshape(node) and self.shape(key)[axes[key]] > 1 and (src, None) in run.axes:
                merged.add(node)
                a, in_shape = run.axes[(src, None)], self.lab.shapes[src]
                ins, _ = _block_of(in_shape, self.shape(key), in_dim=a)
                self.junctions.append(Junction(act.ids.flatten(), _product(in_shape[i] for i in ins if i > a), False))
        for key, dim in run.axes.items():
            if key in self.acts and self.acts[key].param:
                axes[key] = dim
        return axes

    def unsplit(self, act: HeadAct, dims: list[int], merged: set[Node], axes: dict[Key, int]) -> int | None:
        """The axis of a value made from values that hold the head unsplit: the one dim of its coordinates, or
        (coordinates folded by the attention) the axis its inputs share where its rank is theirs."""
        inputs = [a for a in act.node.all_input_nodes if a in self.value_nodes]
        if not all(a in merged for a in inputs):
            return None
        if len(dims) == 1:
            return dims[0]
        rank = len(self.shape((act.node, act.index)))
        shared = {axes[(a, None)] for a in inputs if (a, None) in axes and len(self.lab.shapes[a]) == rank}
        return shared.pop() if inputs and len(shared) == 1 else None

    def element_seed(self, name: str, shape: tuple) -> dict[Node, int]:
        """The dim of a per-head tensor (a relative-position table, a per-head scale) that holds the head: the one
        size-1 dim whose widening reaches the head's values where the head is, and breaks nothing; none (an empty
        seed) for a tensor every head reads alike (a rotary table: the widened head broadcasts over it)."""
        nodes = [n for n in self.lab.module.graph.nodes if n.op == "get_attr" and n.target == name]
        ones = [d for d, size in enumerate(shape) if size == 1]
        if not ones and self.read_alike(nodes):
            return {}
        fits = []
        base_nodes = {k[0] for k in self.base.axes}
        for d in ones:
            run = self.widen({**self.seeds, **{n: d for n in nodes}})
            chain = {k[0] for k in run.axes} - base_nodes
            meets = any(a in chain for n in base_nodes for a in n.all_input_nodes)
            same = all(run.axes.get(k) == v for k, v in self.base.axes.items())
            if nodes and meets and same and set(run.failures) <= set(self.base.failures):
                fits.append(d)
        if len(fits) != 1:
            told = f"dims {fits} all fit" if fits else (f"none of its size-1 dims {ones} fits" if ones else
                                                        "it has no dim of size 1")
            raise Unsupported(f"{name}: a tensor of the one head whose head dim cannot be located ({told})")
        return {n: fits[0] for n in nodes}

    def read_alike(self, nodes: list[Node]) -> bool:
        """Whether the values computed from ``nodes`` alone meet the head's values only in ops the widened head
        passes (broadcast along the head axis), none of them failing: every head would read them alike, as they
        are read where a layer has several heads."""
        axes = {key[0] for key in self.base.axes}
        seen, frontier, meets = set(nodes), list(nodes), []
        while frontier:
            node = frontier.pop()
            for user in node.users:
                if user in seen:
                    continue
                seen.add(user)
                if user in self.base.failures:
                    return False
                if user in axes:
                    meets.append(user)
                elif user.op != "output":
                    frontier.append(user)
        return bool(meets)

    def coordinate_slice(self, name: str, ids: torch.Tensor, unit: torch.Tensor, shape: tuple,
                         sink: Sink) -> ParamSlice:
        """The slice of a projection's rows (or the output projection's columns): the whole dim along which its
        coordinate ids lie, laid out as the junction reshape between merged and split forms says."""
        ids, unit = align(ids, len(shape)), align(unit, len(shape))
        dims = _coordinate_dims(ids, len(shape))
        if not dims and name == sink.weight:  # the head's values were folded by the attention: one id for all
            dims = [sink.weight_dim]
        if len(dims) != 1:
            raise Unsupported(f"{name}: the head's coordinates lie along {len(dims)} dims")
        d = dims[0]
        if not bool(unit.all()):
            raise Unsupported(f"{name}: holds the head's coordinates beside other coordinates")
        output = name == sink.weight and d == sink.weight_dim
        flat = ids.flatten()
        inners = {j.inner for j in self.junctions if j.split != output and bool(torch.isin(j.merged, flat).any())}
        if len(inners) != 1:
            why = "no reshape splits or merges them" if not inners else f"reshapes disagree ({sorted(inners)})"
            raise Unsupported(f"{name}: how the head's coordinates are laid out cannot be told: {why}")
        inner = inners.pop()
        if shape[d] % inner:
            raise Unsupported(f"{name}: {shape[d]} coordinates are no multiple of {inner}")
        return ParamSlice(name, d, shape[d] // inner, inner, output)


def _product(sizes) -> int:
    out = 1
    for size in sizes:
        out *= size
    return out


def _block_of(in_shape: tuple, out_shape: tuple, in_dim: int | None = None,
              out_dim: int | None = None) -> tuple[list[int], list[int]]:
    """The reshape block (input dims, output dims of equal element count) that holds ``in_dim`` or ``out_dim``;
    a block of size-1 dims alone on one side joins the block before it."""
    blocks = [(list(ins), list(outs)) for ins, outs in reshape_blocks(in_shape, out_shape)]
    for k in range(len(blocks) - 1, 0, -1):
        if not blocks[k][0] or not blocks[k][1]:
            blocks[k - 1] = (blocks[k - 1][0] + blocks[k][0], blocks[k - 1][1] + blocks[k][1])
            del blocks[k]
    for ins, outs in blocks:
        if in_dim in ins or out_dim in outs:
            return ins, outs
    return [], []


def _split_ones(in_shape: tuple, out_shape: tuple, dim: int) -> list[int]:
    """Size-1 output dims of the reshape block that splits input dim ``dim`` alone."""
    ins, outs = _block_of(in_shape, out_shape, in_dim=dim)
    if [i for i in ins if in_shape[i] != 1] != [dim]:
        return []
    return [j for j in outs if out_shape[j] == 1]
