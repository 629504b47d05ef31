"""Contractions (matmul, einsum, attention) on ids: what two activations contract is a head."""
from __future__ import annotations

import math
import operator
import string
from typing import NamedTuple, Sequence

import torch
import torch.nn.functional as F
from torch.fx.node import Node

from ..ids import NO_ID, align, compact, expand_dims, fold, merge, pairs, varies
from ..labeller import Label, Step
from ..records import Member, Note, Opaque, SharedRead, Sink, Space
from .base import defer_pins, elementwise_labels, head_axis, held, mix, mixing_map, pin_all, register_rule


class Operand(NamedTuple):
    """One operand of a contraction: its shape and subscripts, its label, and its ids laid out over
    all the contraction's letters (size 1 where it lacks a letter; None when it has no label)."""

    shape: Sequence[int]
    label: Label | None
    subs: str
    ids: torch.Tensor | None

    @property
    def activation(self) -> bool:
        return self.label is not None and not self.label.param

    @property
    def parameter(self) -> bool:
        return self.label is not None and self.label.param


def _operand(shape: Sequence[int], lab: Label | None, sub: str, letters: list[str]) -> Operand:
    if lab is None:
        return Operand(shape, None, sub, None)
    ids = align(lab.ids, len(sub))
    ids = ids.permute([sub.index(c) for c in letters if c in sub])
    full = [1] * len(letters)
    for c, n in zip([c for c in letters if c in sub], ids.shape):
        full[letters.index(c)] = n
    return Operand(shape, lab, sub, ids.reshape(full))


def contract(s: Step, operands: list[tuple[Sequence[int], Label | None]], subs: list[str],
             out_sub: str) -> Label | None:
    """Einsum-style contraction on ids. A linear map written as a product (``_weight_of_map``) starts a space.
    Otherwise a contracted letter that two activations carry ties all its coordinates (q·kᵀ makes a head); against a
    parameter it is a sink; shared batch letters tie positions; against a plain tensor the letter may not be the unit
    axis (units kept on another axis fold their coordinates along it, as against a parameter they share)."""
    letters = sorted(set("".join(subs)) | set(out_sub))
    pos = {c: i for i, c in enumerate(letters)}
    views = [_operand(shape, _unless_broadcast(s, lab), sub, letters) for (shape, lab), sub in zip(operands, subs)]
    if (weight := _weight_of_map(s, views, letters, out_sub)) is not None:
        return _linear_product(s, views, weight, letters, out_sub)
    shared = _share(s, views, letters, out_sub)
    reps, consumed = _share_positions(s, views, letters, out_sub), [set() for _ in views]  # consumed: a sink's axes
    read: set[int] = set()  # the parameters an activation is contracted against
    before = len(s.rec.contracted)
    for c in letters:
        if c in out_sub:
            continue
        ax = pos[c]
        holders = [i for i, v in enumerate(views) if c in v.subs]
        labelled = [i for i in holders if views[i].label is not None and reps[i].shape[ax] > 1]
        if not labelled:
            continue
        acts = [i for i in holders if views[i].activation]
        params = [i for i in holders if views[i].parameter]
        plain = [i for i in holders if views[i].label is None and views[i].shape[views[i].subs.index(c)] > 1]
        if len(acts) >= 2:
            for i in acts:
                s.rec.contracted.append(reps[i])
                reps[i], tie = fold(reps[i], [ax])
                s.rec.tie(tie)
        elif len(acts) == 1 and params and not shared.keys() & set(params) and (
                mixed := _mixed_heads(s, views, reps[acts[0]], params, c, letters, out_sub)) is not None:
            reps[acts[0]] = mixed
        elif len(acts) == 1 and params:
            a = acts[0]
            read.update(params)
            if shared.keys() & set(params):  # contracted against an activation all the same: a head
                s.rec.contracted.append(reps[a])
            for p in params:
                s.rec.tentative.append(pairs(reps[p], reps[a]))
            if not _fold_unit_coordinates(s, reps, a, ax, [pos[k] for k in out_sub]):
                consumed[a].add(ax)
        elif len(acts) == 1 and plain:
            if not _fold_unit_coordinates(s, reps, acts[0], ax, [pos[k] for k in out_sub]):
                s.rec.pin(reps[acts[0]], f"{s.name}: contracted against a plain tensor", False, ax)
                consumed[acts[0]].add(ax)
        elif len(acts) == 1:
            mix(s, reps[acts[0]], [ax], "sum over a unit axis")
            consumed[acts[0]].add(ax)
        else:
            s.rec.pin(reps[labelled[0]], f"{s.name}: contraction of parameters")
            return None
    _note_unstarted(s, views, reps, read, letters, out_sub)
    out = _output_label(s, views, reps, consumed, letters, out_sub)
    if out is not None and sum(v.activation for v in views) + len(shared) >= 2:
        s.rec.products.append(out.ids)
        if len(s.rec.contracted) == before or _reads_applied(s, views):
            s.rec.applied.append(out.ids)
    return out


def _reads_applied(s: Step, views: list[Operand]) -> bool:
    """Whether an activation operand already holds weights applied to values (``Records.applied``): a product with
    it is values too, whatever it contracts (linear attention's ``q @ (softmax(k)ᵀ @ v)``), never attention logits."""
    if not s.rec.applied:
        return False
    applied = torch.cat([ids.flatten() for ids in s.rec.applied])
    return any(torch.isin(v.label.ids, applied).any() for v in views if v.activation)


def _unless_broadcast(s: Step, lab: Label | None) -> Label | None:
    """``lab``, or None for a plain tensor an ``expand`` broadcast (``Records.broadcasts``): a product reads its values,
    which are no parameter's, as it reads the tensor before the broadcast (a position table broadcast over the
    batch and mapped by a weight starts a space; beside the units it refuses them)."""
    return None if lab is not None and held(lab.ids, s.rec.broadcasts) else lab


class MapWeight(NamedTuple):
    """The parameter of a linear map written as a product: its operand's position, its name, and the listing of its
    elements' ids (which the operand's ids lay out)."""

    index: int
    name: str
    elements: Member


def _weight_of_map(s: Step, views: list[Operand], letters: list[str], out_sub: str) -> MapWeight | None:
    """The parameter that makes this contraction a linear map (``x @ W.T``, ``einsum("ibh,hnd->ibnd", h, W)``), or
    None: two operands, a parameter read whole (through views) and an activation or plain tensor, that share only
    the letters they contract; the parameter's other letters are the output's own dims. The activation's ids vary
    along the contracted letters only (units kept on another axis read a table, ``_fold_unit_coordinates``), and
    those are no heads axis of attention weights (a map over heads mixes them, ``_mixed_heads``)."""
    params = [i for i, v in enumerate(views) if v.parameter]
    if len(views) != 2 or len(params) != 1 or s.lab.nested:
        return None
    w, x = views[params[0]], views[1 - params[0]]
    contracted = [c for c in w.subs if c in x.subs]
    own = [c for c in w.subs if c not in x.subs]
    if not contracted or not own or any(c in out_sub for c in contracted) or any(c not in out_sub for c in own):
        return None
    pos = {c: i for i, c in enumerate(letters)}
    if x.activation and (any(varies(x.ids, pos[c]) for c in out_sub) or any(
            head_axis(s, x.ids, pos[c]) is not None for c in contracted)):
        return None
    node = _node_of(s, w.label)
    name = _parameter_name(node) if node is not None else None
    elements = torch.sort(w.ids.flatten()).values
    listing = next((m for m in s.rec.members if m.name == name and m.ids.numel() == elements.numel()
                    and torch.equal(m.ids.flatten(), elements)), None) if elements.numel() else None
    return None if listing is None else MapWeight(params[0], name, listing)


def _linear_product(s: Step, views: list[Operand], weight: MapWeight, letters: list[str], out_sub: str) -> Label:
    """A linear map written as a product, labelled as ``linear_labels`` labels ``F.linear``: the output's own dims
    (the weight's dims the input lacks) are a new space, whose coordinates own the weight's elements along them; an
    activation's coordinates along the contracted dims are consumed, read by the weight's elements along those
    (its sink: the weight dim of the first contracted letter, its input's dim of that letter)."""
    pos = {c: i for i, c in enumerate(letters)}
    w, x = views[weight.index], views[1 - weight.index]
    full = w.ids.shape
    own = [c for c in w.subs if c not in x.subs]
    own_shape = [full[pos[c]] for c in own]
    space = s.rec.fresh(tuple(own_shape))
    s.rec.spaces.append(Space(int(space.flatten()[0]) if space.numel() else s.rec.next_id, s.rec.next_id, s.name))
    laid = space.permute([own.index(c) for c in letters if c in own]).reshape(
        [full[i] if c in own else 1 for i, c in enumerate(letters)])
    s.rec.member(weight.name, _by_element(weight, w.ids, laid))
    if x.activation:
        contracted = [c for c in w.subs if c in x.subs]
        columns = x.ids.expand([full[i] if c in contracted else 1 for i, c in enumerate(letters)])
        s.rec.member(weight.name, _by_element(weight, w.ids, columns))
        first = next((c for c in contracted if varies(x.ids, pos[c])), contracted[0])
        read = columns.permute([pos[c] for c in contracted] + [pos[c] for c in letters if c not in contracted])
        source = _node_of(s, x.label)
        s.rec.sinks.append(Sink(weight.name, s.name, read.flatten(), x.subs.index(first),
                                _weight_dim(weight, w.ids, pos[first]), None if source is None else source.name))
    out = laid.permute([pos[c] for c in out_sub] + [pos[c] for c in letters if c not in out_sub])
    return Label(compact(out.reshape(out.shape[:len(out_sub)])))


def _by_element(weight: MapWeight, elements: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``ids`` (laid out as the weight's ``elements`` are in the contraction) in the weight's own layout: the ids a
    member listing of it gives its elements."""
    first = int(weight.elements.ids.flatten()[0])
    flat = torch.empty(elements.numel(), dtype=torch.long)
    flat[elements.flatten() - first] = torch.broadcast_to(ids, elements.shape).flatten()
    return compact(flat.reshape(weight.elements.ids.shape))


def _weight_dim(weight: MapWeight, elements: torch.Tensor, ax: int) -> int:
    """The weight's own dim along which its elements change where the contraction's axis ``ax`` does."""
    shape = weight.elements.ids.shape
    step = (elements.narrow(ax, 1, 1) - elements.narrow(ax, 0, 1)).flatten()[0] if elements.shape[ax] > 1 else 0
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    return next((d for d, stride in enumerate(strides) if shape[d] > 1 and stride == int(step)),
                next(d for d, n in enumerate(shape) if n > 1))


def _note_unstarted(s: Step, views: list[Operand], reps: list[torch.Tensor | None], read: set[int],
                    letters: list[str], out_sub: str) -> None:
    """A parameter an activation is contracted against that lays out output dims of its own, where the product is
    no linear map of the input's features (``_weight_of_map``: the weight is computed from parameters, or the
    input's units lie along dims the product keeps): it starts no unit space, so what it makes is noted, to be told
    if no group is found where it runs."""
    if s.lab.nested:
        return
    for p in sorted(read):
        v = views[p]
        own = [c for c in v.subs if c in out_sub and v.shape[v.subs.index(c)] > 1
               and all(reps[i].shape[letters.index(c)] == 1 for i, w in enumerate(views) if w.activation)]
        if own:
            name = _parameter_name(_node_of(s, v.label))
            s.rec.unstarted.append(Opaque(s.node, f"{s.name}: multiplies by the parameter {name}, whose own dims make "
                                                  "the output's, but not as a linear map of its input's features (a "
                                                  "weight computed from parameters, or an input whose units lie "
                                                  "along dims the product keeps): it starts no unit space, so the "
                                                  "heads or channels it makes are not found"))
            return


def _parameter_name(node: Node | None) -> str:
    """The parameter an operand reads, through the views taken of it (``W.T``), or a phrase saying it is computed."""
    for _ in range(4):
        if node is None or node.op == "get_attr":
            break
        inputs = node.all_input_nodes
        node = inputs[0] if len(inputs) == 1 else None
    return node.target if node is not None else "(computed from parameters)"


def _fold_unit_coordinates(s: Step, reps: list[torch.Tensor | None], a: int, ax: int, kept: Sequence[int]) -> bool:
    """Units kept on another axis (heads) that contract their coordinates along ``ax`` against a tensor they
    share (a relative-position table, a parameter or a tensor computed from one): each unit's coordinates go
    together and it stays a unit, so the shared tensor is read whole by every unit. False (nothing done) where
    the activation's ids vary along no ``kept`` axis."""
    if not any(varies(reps[a], k) for k in kept):
        return False
    reps[a], tie = fold(reps[a], [ax])
    s.rec.tie(tie)
    return True


def _read_alike(views: list[Operand], letters: list[str], out_sub: str) -> dict[int, list[tuple[str, int]]]:
    """The activations that the units of another activation read alike, each with the letters (and that other
    operand) along which they do: a letter the output keeps, which both carry, along which the other's ids vary
    and theirs do not (one key/value head broadcast, or repeated by an expand, to every query head). An operand
    that two activations would read alike of each other is neither's."""
    pos = {c: i for i, c in enumerate(letters)}
    acts = [i for i, v in enumerate(views) if v.activation]

    def along(i: int, j: int) -> list[str]:
        return [c for c in out_sub if c in views[i].subs and varies(views[j].ids, pos[c])
                and not varies(views[i].ids, pos[c])]
    found: dict[int, list[tuple[str, int]]] = {}
    for i in acts:
        for j in acts:
            if j != i and along(i, j) and not along(j, i):
                found.setdefault(i, []).extend((c, j) for c in along(i, j))
    return found


def _share(s: Step, views: list[Operand], letters: list[str], out_sub: str) -> dict[int, list[tuple[str, int]]]:
    """The operands read alike by the units of others (``_read_alike``), made parameters of ``views`` in place:
    like a parameter they share, their coordinates join no unit and, being no unit axis themselves, stay whole;
    their size along each such letter still follows those units' count (``SharedRead``)."""
    shared = _read_alike(views, letters, out_sub)
    for i, along in shared.items():
        v = views[i]
        s.rec.pin(v.label.ids, f"{s.name}: an operand read alike by each of the units it is contracted with",
                  benign=True)
        node = None if s.lab.nested else _node_of(s, v.label)
        for c, j in along:
            s.rec.shared_reads.append(SharedRead(s.name, node, v.subs.index(c), views[j].label.ids))
        views[i] = v._replace(label=Label(v.label.ids, True))
    return shared


def _share_positions(s: Step, views: list[Operand], letters: list[str], out_sub: str) -> list[torch.Tensor | None]:
    """Positions of a contracted letter at which the units of another activation read an activation alike, beside
    positions of their own (a key of per-head coordinates with one rotary part every head shares:
    ``cat([k_heads, k_rot.expand(...)], -1)``): like an operand read alike as a whole (``_share``), those
    coordinates join no unit (pinned, and no id of the operand there) and their size along the units' letter still
    follows the units' count (``SharedRead``). Returns the operands' ids over every letter, without them."""
    pos = {c: i for i, c in enumerate(letters)}
    acts = [i for i, v in enumerate(views) if v.activation]
    reps = [v.ids for v in views]
    for i in acts:
        for c in (c for c in views[i].subs if c not in out_sub and reps[i].shape[pos[c]] > 1):
            for k, j in ((k, j) for k in out_sub for j in acts if j != i and k in views[i].subs and
                         varies(reps[j], pos[k]) and varies(reps[i], pos[k])):
                by_position = [t.movedim(pos[c], 0).reshape(reps[i].shape[pos[c]], -1)
                               for t in (reps[i] == reps[i].narrow(pos[k], 0, 1), reps[i] != NO_ID)]
                alike = by_position[0].all(1) & by_position[1].any(1)
                if not alike.any() or alike.all():
                    continue
                at = alike.nonzero().flatten()
                s.rec.pin(reps[i].index_select(pos[c], at), f"{s.name}: coordinates read alike by each of the "
                          "units they are contracted with", benign=True)
                reps[i] = reps[i].clone().index_fill_(pos[c], at, NO_ID)
                node = None if s.lab.nested else _node_of(s, views[i].label)
                s.rec.shared_reads.append(SharedRead(s.name, node, views[i].subs.index(k), views[j].label.ids))
    return reps


def _mixed_heads(s: Step, views: list[Operand], ids: torch.Tensor, params: list[int], c: str, letters: list[str],
                 out_sub: str) -> torch.Tensor | None:
    """Heads mixed by a heads×heads parameter (talking heads: ``b h i j, h g -> b g i j``, ``base.mixing_map``): the
    activation's ids move from the contracted letter to the one the map makes. None where this is no such mixing
    (the map is then a parameter the heads read); a mixing that cannot be sliced is pinned."""
    pos = {k: i for i, k in enumerate(letters)}
    p = views[params[0]]
    made = [k for k in p.subs if k != c and k in out_sub and not any(k in v.subs for v in views if v.activation)]
    heads = head_axis(s, ids, pos[c]) if len(params) == 1 and len(p.subs) == 2 and len(made) == 1 else None
    if heads is None:
        return None
    n, state = heads.numel(), _state_node(s, p.label)
    produced = p.shape[p.subs.index(made[0])]
    if state is None or produced != n:
        why = "a computed map" if state is None else f"a map to {produced} heads"
        s.rec.pin(ids, f"{s.name}: {n} heads mixed by {why}: a head is not one unit on both sides")
        return None
    act = next(v for v in views if v.activation)
    mixing_map(s, state.target, heads, read=p.subs.index(c), made=p.subs.index(made[0]), source=_node_of(s, act.label),
               dim=act.subs.index(c))
    full = [1] * len(letters)
    full[pos[made[0]]] = n
    return heads.reshape(full)


def _state_node(s: Step, label: Label | None) -> Node | None:
    """The node reading the parameter or buffer an operand with ``label`` is (its target the name; None for a computed
    tensor)."""
    nodes = [n for n in s.node.all_input_nodes if s.lab.labels.get(n) is label and n.op == "get_attr"]
    return nodes[0] if nodes else None


def _node_of(s: Step, label: Label | None) -> Node | None:
    """The argument node of an operand with ``label`` (None if the operand is no node of the graph)."""
    nodes = [n for n in s.node.all_input_nodes if s.lab.labels.get(n) is label]
    return nodes[0] if nodes else None


def _output_label(s: Step, views: list[Operand], reps: list[torch.Tensor | None], consumed: list[set[int]],
                  letters: list[str], out_sub: str) -> Label | None:
    """The activations' ids with contracted letters dropped (a letter consumed by a sink carries no
    coordinate any more), merged, in the order of ``out_sub``."""
    pos = {c: i for i, c in enumerate(letters)}
    out = None
    for i, v in enumerate(views):
        if not v.activation:
            continue
        r = reps[i]
        for c in letters:
            if c in out_sub:
                continue
            ax = pos[c]
            if ax in consumed[i] and r.shape[ax] > 1:
                r = torch.full_like(r.narrow(ax, 0, 1), NO_ID)
            elif r.shape[ax] > 1:
                r = r.amax(dim=ax, keepdim=True)
        if out is None:
            out = r
        else:
            out, tie = merge(out, r)
            s.rec.tie(tie)
    if out is None:
        return None
    for v in views:
        if v.label is None:
            full = [1] * len(letters)
            for c, n in zip(v.subs, v.shape):
                if c in out_sub:
                    full[pos[c]] = n
            defer_pins(s, out, full, "a plain operand", benign=False)
    out = out.permute([pos[c] for c in out_sub] + [pos[c] for c in letters if c not in out_sub])
    out = out.reshape(out.shape[: len(out_sub)])
    if (out == NO_ID).all():
        return None
    return Label(compact(out))


_BATCH = string.ascii_lowercase[:20]


def matmul_subs(ra: int, rb: int) -> tuple[str, str, str]:
    """Einsum subscripts of ``a @ b`` for operand ranks ``ra`` and ``rb`` (batch dims broadcast)."""
    n, k, m = "xyz"
    nb = max(ra, rb) - 2
    batch = _BATCH[:max(nb, 0)]
    a = (batch[len(batch) - (ra - 2):] if ra > 2 else "") + (n + k if ra >= 2 else k)
    b = (batch[len(batch) - (rb - 2):] if rb > 2 else "") + (k + m if rb >= 2 else k)
    out = batch + (n if ra >= 2 else "") + (m if rb >= 2 else "")
    return a, b, out


@register_rule(torch.matmul, operator.matmul, torch.bmm, torch.mm, "matmul", "bmm", "mm")
def matmul(s: Step) -> Label | None:
    (a, la), (b, lb) = list(s.tensors())[:2]
    sa, sb, so = matmul_subs(a.dim(), b.dim())
    return contract(s, [(a.shape, la), (b.shape, lb)], [sa, sb], so)


@register_rule(torch.baddbmm, "baddbmm")
def baddbmm(s: Step) -> Label | None:
    """``beta * input + alpha * (batch1 @ batch2)``: the product's coordinates, tied position by position to the
    input's (a score bias added to the scores)."""
    (x, lx), (a, la), (b, lb) = s.arg(0, "input"), s.arg(1, "batch1"), s.arg(2, "batch2")
    product = contract(s, [(a.shape, la), (b.shape, lb)], ["bxk", "bky"], "bxy")
    if product is None and lx is None:
        return None
    operands = [(torch.empty(s.out.shape, device="meta"), product), (x, lx)]
    return elementwise_labels(s, operands, s.out.dim())


def parse_einsum(eq: str, ranks: Sequence[int]) -> tuple[list[str], str]:
    eq = eq.replace(" ", "")
    lhs, _, rhs = eq.partition("->")
    subs = lhs.split(",")
    spare = iter(c for c in string.ascii_uppercase if c not in eq)
    ell = ""
    if "..." in eq:
        n_ell = max(r - (len(sub) - 3) for r, sub in zip(ranks, subs) if "..." in sub)
        ell = "".join(next(spare) for _ in range(n_ell))
        subs = [sub.replace("...", ell[len(ell) - (r - (len(sub) - 3)):]) if "..." in sub else sub
                for sub, r in zip(subs, ranks)]
    if not _:
        counts = {c: "".join(subs).count(c) for c in set("".join(subs))}
        rhs = ell + "".join(sorted(c for c, k in counts.items() if k == 1 and c not in ell))
    else:
        rhs = rhs.replace("...", ell)
    return subs, rhs


@register_rule(torch.einsum)
def einsum(s: Step) -> Label | None:
    eq = s.args[0]
    ops = list(s.tensors())
    subs, out_sub = parse_einsum(eq, [v.dim() for v, _ in ops])
    return contract(s, [(v.shape, lab) for v, lab in ops], subs, out_sub)


def _repeat_heads(s: Step, t: torch.Tensor, lab: Label | None, times: int) -> tuple[torch.Tensor, Label | None]:
    """Key or value heads as the query heads see them (each repeated ``times``), and a note that a key/value head's
    query heads are in its unit (a unit may hold several key/value heads: differential attention pairs them)."""
    shape = (*t.shape[:-3], t.shape[-3] * times, *t.shape[-2:])
    if lab is None:
        return torch.empty(shape, device="meta"), None
    ids = expand_dims(align(lab.ids, t.dim()), t.shape, [t.dim() - 3]).repeat_interleave(times, dim=t.dim() - 3)
    s.rec.notes.append(Note(lab.ids, f"a key/value head and its {times} query heads are in one unit"))
    return torch.empty(shape, device="meta"), Label(ids, lab.param)


@register_rule(F.scaled_dot_product_attention)
def sdpa(s: Step) -> Label | None:
    (q, lq), (k, lk), (v, lv) = s.arg(0, "query"), s.arg(1, "key"), s.arg(2, "value")
    mask, lmask = s.arg(3, "attn_mask")
    if q.dim() < 3 or q.dim() != k.dim() or k.shape[:-3] != q.shape[:-3]:
        pin_all(s, "attention with query and key batch dims that differ has no rule")
        return None
    heads, kv_heads = q.shape[-3], k.shape[-3]
    # one key/value head broadcasts to every query head (multi-query attention): the contractions read it alike
    if kv_heads not in (1, heads):  # grouped-query attention: query head h reads key/value head h // (heads / kv_heads)
        if not s.arg(7, "enable_gqa", False)[0] or kv_heads == 0 or heads % kv_heads:
            pin_all(s, f"attention of {heads} query heads on {kv_heads} key/value heads")
            return None
        (k, lk), (v, lv) = (_repeat_heads(s, t, lab, heads // kv_heads) for t, lab in ((k, lk), (v, lv)))
    nb = q.dim() - 2
    batch = _BATCH[:nb]
    scores_shape = tuple(q.shape[:-1]) + (k.shape[-2],)
    scores = contract(s, [(q.shape, lq), (k.shape, lk)], [batch + "le", batch + "se"], batch + "ls")
    if torch.is_tensor(mask):
        ops = [(torch.empty(scores_shape, device="meta"), scores), (mask, lmask)]
        scores = elementwise_labels(s, ops, len(scores_shape)) if scores or lmask else None
    if scores is not None:
        mix(s, align(scores.ids, len(scores_shape)), [len(scores_shape) - 1], "softmax over keys")
    return contract(s, [(scores_shape, scores), (v.shape, lv)], [batch + "ls", batch + "sv"], batch + "lv")
