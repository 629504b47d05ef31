"""timm's parallel block (`ParallelScalingBlock`): one Linear makes the MLP hidden and q, k, v side by side, and
the attention and MLP outputs are read by two output projections or by one over their concatenation. A head owns
its rows in the q, k and v sections and its output columns; an FFN channel its row in the MLP section and its
output column. The references here are built from the block's own layout, never from fxsurgery's slices: a removal
equals masking the unit through `tap`, and equals the original model with the unit's true output columns zeroed."""
from __future__ import annotations

import copy
import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from timm.models.vision_transformer import ParallelScalingBlock, VisionTransformer

from fxsurgery import AnalysisError, ParamSlice, Surgeon, UnservedCall
from fxsurgery.slicing import clone_unit

DIM, HEADS, HIDDEN = 12, 3, 24
HEAD_DIM = DIM // HEADS
EXAMPLES = settings.default.max_examples  # per property test, from the loaded profile
VARIANTS = {"separate": dict(fuse_out_proj=False, qkv_bias=False, qk_norm=False),
            "fused_out": dict(fuse_out_proj=True, qkv_bias=True, qk_norm=True)}


def build(variant: str) -> VisionTransformer:
    torch.manual_seed(0)
    options = VARIANTS[variant]
    block = functools.partial(ParallelScalingBlock, fuse_out_proj=options["fuse_out_proj"])
    model = VisionTransformer(img_size=16, patch_size=8, embed_dim=DIM, depth=2, num_heads=HEADS,
                              mlp_ratio=HIDDEN / DIM, num_classes=5, block_fn=block, class_token=False,
                              no_embed_class=True, reg_tokens=1, global_pool="avg", qkv_bias=options["qkv_bias"],
                              qk_norm=options["qk_norm"]).double()
    with torch.no_grad():  # weights of unit scale, so a wrong slice shows far above the tolerance
        for p in model.parameters():
            p.normal_(0, 0.5)
    return model


def images() -> torch.Tensor:
    return torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


def output_columns(block: ParallelScalingBlock, kind: str, unit: int, heads: int = HEADS
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The output projection's weight and the columns that read ``unit`` of the block (of ``heads`` heads now), from
    the block's layout: heads first and channels after them in a fused projection's input."""
    if block.out_proj is not None:
        heads = heads * block.head_dim
        start = unit * block.head_dim if kind == "head" else heads + unit
        return block.out_proj.weight, torch.arange(start, start + (block.head_dim if kind == "head" else 1))
    weight = block.attn_out_proj.weight if kind == "head" else block.mlp_out_proj.weight
    size = block.head_dim if kind == "head" else 1
    return weight, torch.arange(unit * size, (unit + 1) * size)


def zeroed(model: VisionTransformer, removed: list[tuple[int, str, int]]) -> VisionTransformer:
    """A copy of the original model with the output columns of each (block, kind, unit) zeroed."""
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for index, kind, unit in removed:
            weight, columns = output_columns(reference.blocks[index], kind, unit)
            weight[:, columns] = 0
    return reference


def group(surgeon: Surgeon, index: int, kind: str):
    return surgeon.group(f"blocks.{index}:{kind}")


def masked(surgeon: Surgeon, model: VisionTransformer, x: torch.Tensor, kind: str, index: int, unit: int
           ) -> torch.Tensor:
    """The outputs with ``unit`` of a block's group zeroed at its tap point."""
    return masked_by(surgeon, model, x, group(surgeon, index, kind), unit)


def masked_by(surgeon: Surgeon, model: torch.nn.Module, x: torch.Tensor, g, unit: int) -> torch.Tensor:
    """The outputs with ``unit`` of group ``g`` zeroed at its tap point."""
    def zero(a: torch.Tensor) -> None:
        a.select(-2, unit).zero_()
    handle = surgeon.tap(g, zero)
    try:
        with torch.no_grad():
            return model(x)
    finally:
        handle.remove()


@pytest.mark.parametrize("variant", VARIANTS)
def test_heads_and_channels_are_separate_exact_groups(variant: str) -> None:
    model = build(variant)
    s = Surgeon(model, (images(),))
    assert sorted((g.name, g.kind, g.count, g.exact) for g in s.groups) == [
        (f"blocks.{i}:{kind}", kind, count, True) for i in range(2) for kind, count in (("channel", HIDDEN),
                                                                                         ("head", HEADS))]
    heads = group(s, 0, "head")
    rows = next(sl for sl in heads.slices if sl.name == "blocks.0.in_proj.weight")
    assert (rows.dim, rows.outer, rows.inner, rows.start) == (0, 3, HEAD_DIM, HIDDEN)  # after the MLP section
    block = model.blocks[0]  # unit norms from the block's own layout: q, k, v rows and output columns
    rows = block.in_proj.weight.detach()[HIDDEN:].reshape(3, HEADS, HEAD_DIM, DIM).square().sum((0, 2, 3))
    if block.in_proj.bias is not None:
        rows = rows + block.in_proj.bias.detach()[HIDDEN:].reshape(3, HEADS, HEAD_DIM).square().sum((0, 2))
    out = [output_columns(block, "head", h) for h in range(HEADS)]
    expected = (rows + torch.stack([w.detach()[:, c].square().sum() for w, c in out])).sqrt()
    assert torch.allclose(s.unit_norms(heads).double(), expected, rtol=1e-6)
    text = s.explain()
    assert "a unit is one attention head of a projection fused with other layers" in text
    assert "a unit is one FFN channel of a projection fused with other layers" in text
    assert "fused projection of parallel layers" not in text


@pytest.mark.parametrize("variant", VARIANTS)
def test_removals_equal_masking_and_the_zeroed_reference_and_clones_preserve(variant: str) -> None:
    """Removals in both segments of the fused tensors, in turn (each moves the segments after it), then clones;
    in eval and train mode (no dropout: the modes agree)."""
    model = build(variant)
    original = copy.deepcopy(model)
    x = images()
    s = Surgeon(model, (x,))
    left = {(index, kind): list(range(HEADS if kind == "head" else HIDDEN)) for index in range(2)
            for kind in ("head", "channel")}  # the original index of each unit left, in order
    removed = []
    for index, kind, unit in ((0, "head", 1), (0, "channel", 5), (1, "channel", 0), (1, "head", 2),
                              (0, "head", 0), (0, "channel", 20)):
        y_mask = {mode: masked(s, model.train(mode), x, kind, index, unit) for mode in (False, True)}
        s.remove(group(s, index, kind), unit)
        removed.append((index, kind, left[(index, kind)].pop(unit)))
        reference = zeroed(original, removed)
        for mode in (False, True):
            model.train(mode), reference.train(mode)
            with torch.no_grad():
                y = model(x)
                assert (y - y_mask[mode]).abs().max() <= 1e-9
                assert (y - reference(x)).abs().max() <= 1e-9
    wider = torch.randn(3, 3, 16, 16, dtype=torch.float64)  # a new call signature: captured at the current counts
    with torch.no_grad():
        assert (model(wider) - reference(wider)).abs().max() <= 1e-9
    for index, kind, parent in ((0, "channel", 3), (0, "head", 0), (1, "head", 1), (1, "channel", 9)):
        g = group(s, index, kind)
        with torch.no_grad():
            before = model(x)
            s.clone(g, parent, noise_std=0.3)
            assert (model(x) - before).abs().max() <= 1e-9


@pytest.mark.parametrize("variant", VARIANTS)
def test_adam_state_follows_the_segments(variant: str) -> None:
    """After steps of Adam: a removal drops the unit's rows and columns of every state tensor (the rest bit-identical,
    by the block's own layout), a clone starts the parent's and the new unit's state at zero."""
    model = build(variant)
    x = images()
    s = Surgeon(model, (x,))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    s.attach_optimizer(opt)
    for _ in range(2):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    block = model.blocks[0]
    weight = block.in_proj.weight
    old = {k: v.clone() for k, v in opt.state[weight].items() if v.dim()}
    head = 1
    s.remove(group(s, 0, "head"), head)
    sections = [HIDDEN + k * DIM + head * HEAD_DIM for k in range(3)]
    gone = torch.cat([torch.arange(start, start + HEAD_DIM) for start in sections])
    kept = torch.tensor([r for r in range(HIDDEN + 3 * DIM) if r not in set(gone.tolist())])
    for key, value in old.items():
        assert opt.state[weight][key].shape == weight.shape
        assert torch.equal(opt.state[weight][key], value[kept])
    old = {k: v.clone() for k, v in opt.state[weight].items() if v.dim()}
    parent = 3
    s.clone(group(s, 0, "channel"), parent, noise_std=0.1)
    assert weight.shape[0] == HIDDEN + 1 + 3 * (DIM - HEAD_DIM)
    for key, value in old.items():
        state = opt.state[weight][key]
        assert state.shape == weight.shape
        assert torch.equal(state[HIDDEN + 1:], value[HIDDEN:])  # the head sections moved by one row
        assert torch.equal(state[[r for r in range(HIDDEN) if r != parent]], value[[r for r in range(HIDDEN)
                                                                                     if r != parent]])
        assert not state[parent].any() and not state[HIDDEN].any()
    out, columns = output_columns(block, "channel", HIDDEN, heads=HEADS - 1)
    assert opt.state[out]["exp_avg"].shape == out.shape and not opt.state[out]["exp_avg"][:, columns].any()


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_layer_down_to_one_head_and_one_channel_still_trains(variant: str) -> None:
    model = build(variant)
    x = images()
    s = Surgeon(model, (x,))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    s.attach_optimizer(opt)
    s.keep(group(s, 0, "head"), [2])
    s.keep(group(s, 0, "channel"), [7])
    s.keep(group(s, 1, "head"), [0])
    block = model.blocks[0]
    assert block.in_proj.weight.shape[0] == 1 + 3 * HEAD_DIM
    before = copy.deepcopy(model.state_dict())
    losses = []
    for mode in (True, False, True):
        model.train(mode)
        for _ in range(3):
            opt.zero_grad()
            loss = model(x).logsumexp(1).mean()
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]
    changed = [k for k, v in model.state_dict().items() if k.startswith("blocks.0.") and not torch.equal(v, before[k])]
    assert "blocks.0.in_proj.weight" in changed


def test_a_call_its_graphs_cannot_take_is_refused_naming_the_block() -> None:
    """A hook inside the block leaves the call to the block's own forward, which keeps its split sizes in a list
    attribute that does not follow the counts: refused, naming the block and why."""
    model = build("fused_out")
    x = images()
    s = Surgeon(model, (x,))
    s.remove(group(s, 0, "channel"), 3)
    model.blocks[0].in_norm.register_forward_hook(lambda module, args, out: None)
    with pytest.raises(UnservedCall, match=r"blocks\.0 \(ParallelScalingBlock\) cannot serve .* hooks on in_norm"):
        model(x)


class SlicedParallel(torch.nn.Module):
    """A parallel block that picks the MLP hidden and q, k, v out of its fused projection by slicing: an offset
    there follows the other part's width, which no count of one group rewrites."""

    def __init__(self):
        super().__init__()
        self.in_proj, self.out = torch.nn.Linear(DIM, HIDDEN + 3 * DIM), torch.nn.Linear(DIM + HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        y = self.in_proj(x)
        hidden, qkv = y[..., :HIDDEN], y[..., HIDDEN:]
        q, k, v = qkv.reshape(b, n, 3, HEADS, HEAD_DIM).permute(2, 0, 3, 1, 4).unbind(0)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, DIM)
        return x + self.out(torch.cat([o, torch.nn.functional.gelu(hidden)], -1))


def test_offsets_into_a_fused_projection_are_refused_naming_the_node() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, DIM), SlicedParallel(), torch.nn.Linear(DIM, 3))
    with pytest.raises(AnalysisError, match=r"getitem\w*: a size on the unit axis of a value that holds other "
                                            r"coordinates beside the units"):
        Surgeon(model, (torch.randn(2, 4, 5),))


class EllipsisSliced(torch.nn.Module):
    """q, k and v picked out of one projection by ``y[..., a:b]``: the bounds follow the heads."""

    def __init__(self):
        super().__init__()
        self.qkv, self.proj = torch.nn.Linear(DIM, 3 * DIM), torch.nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        y = self.qkv(x)
        q, k, v = (y[..., i * DIM:(i + 1) * DIM].reshape(b, n, HEADS, HEAD_DIM).transpose(1, 2) for i in range(3))
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, DIM)
        return x + self.proj(o)


def test_slice_bounds_after_an_ellipsis_follow_the_heads() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, DIM), EllipsisSliced(), torch.nn.Linear(DIM, 3)).double()
    x = torch.randn(2, 4, 5, dtype=torch.float64)
    s = Surgeon(model, (x,))
    g = s.group("1:head")
    with torch.no_grad():
        y_mask = masked_by(s, model, x, g, 1)
        s.remove(g, 1)
        assert (model(x) - y_mask).abs().max() <= 1e-9


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_head_removed_leaves_the_mlp_segment_working(variant: str) -> None:
    """A block's q, k, v sections emptied (its attention adds nothing), then a channel removed from the segment
    before them: both equal the zeroed reference."""
    model = build(variant)
    original = copy.deepcopy(model)
    x = images()
    s = Surgeon(model, (x,))
    heads = group(s, 0, "head")
    s.keep(heads, [])
    s.remove(group(s, 0, "channel"), 2)
    assert s.unit_norms(heads).shape == (0,)  # its empty segments moved with the channels' (fused_out: before them)
    s.keep(heads, [])
    reference = zeroed(original, [(0, "head", h) for h in range(HEADS)] + [(0, "channel", 2)])
    assert model.blocks[0].in_proj.weight.shape[0] == HIDDEN - 1
    with torch.no_grad():
        assert (model(x) - reference(x)).abs().max() <= 1e-9


layouts = st.lists(st.tuples(st.integers(1, 3), st.integers(1, 3), st.integers(0, 4)), min_size=1, max_size=4)
edits = st.lists(st.tuples(st.integers(0, 3), st.booleans(), st.integers(0, 8), st.integers(0, 255)), max_size=10)


@settings(max_examples=EXAMPLES)
@given(layout=layouts, steps=edits)
def test_segments_of_one_dim_follow_any_edits_of_their_groups(layout: list, steps: list) -> None:
    """Groups of (outer, inner, count) side by side along one dim, kept and cloned in any order (down to none and
    back) through their `ParamSlice`s, each edit moving the others' segments as the engine does: every element is
    where a list of labelled positions says, and every segment lies where the groups before it end."""
    units = [[(g, i) for i in range(count)] for g, (_, _, count) in enumerate(layout)]

    def labels() -> list:
        return [(g, o, u, r) for g, (outer, inner, _) in enumerate(layout) for o in range(outer) for u in units[g]
                for r in range(inner)]

    values = {label: float(k) for k, label in enumerate(labels())}
    t = torch.tensor(list(values.values()), dtype=torch.float64)
    slices, at = [], 0
    for outer, inner, count in layout:
        slices.append(ParamSlice("w", 0, outer, inner, False, at, len(values) - at - outer * count * inner))
        at += outer * count * inner
    fresh = len(values)
    for g, clone, unit, pick in steps:
        g %= len(layout)
        sl, n = slices[g], len(units[g])
        if clone and n:
            parent = units[g][unit % n]
            t = clone_unit(t, sl, n, unit % n, None)
            units[g].append((g, fresh))
            values.update({(g, o, (g, fresh), r): values[(g, o, parent, r)] for o in range(sl.outer)
                           for r in range(sl.inner)})
            fresh += 1
        else:
            index = [i for i in range(n) if pick >> i & 1]
            t = sl.keep(t, n, torch.tensor(index, dtype=torch.long))
            units[g] = [units[g][i] for i in index]
        delta = (len(units[g]) - n) * sl.outer * sl.inner
        slices = [other.shifted(sl, delta) if k != g else other for k, other in enumerate(slices)]
        assert torch.equal(t, torch.tensor([values[label] for label in labels()], dtype=torch.float64))
        at = 0
        for other, (outer, inner, _), group_units in zip(slices, layout, units):
            size = outer * len(group_units) * inner
            assert (other.start, other.after) == (at, t.numel() - at - size)
            at += size
