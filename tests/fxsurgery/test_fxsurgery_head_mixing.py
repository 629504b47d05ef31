"""Heads mixed by learnable heads×heads maps (talking heads before and after the softmax, re-attention after it):
a head owns its q/k/v rows, its row and column of each map and its output columns, and its group is exact
where the mixing is linear. The references here are built from the models' own layout, never from fxsurgery's
slices: a removal equals masking the head at every point it enters the others."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from zoo import train_steps

from fxsurgery import Surgeon

DIM, HEADS, HEAD_DIM = 6, 3, 2


class MixedHeads(nn.Module):
    """Attention whose heads are mixed by ``pre`` (logits) and ``post`` (weights) maps: parameters applied with
    ``bhij,hg->bgij``, or with ``linear`` Linear layers over the heads axis moved last (timm's talking heads, with
    a bias); ``norm`` adds re-attention's layer norm over the heads axis (a normalisation over units: not exact)."""

    def __init__(self, pre: bool, post: bool, norm: bool = False, heads: int = HEADS, drop: float = 0.0,
                 linear: bool = False):
        super().__init__()
        self.h = heads
        self.qkv, self.proj = nn.Linear(DIM, 3 * heads * HEAD_DIM), nn.Linear(heads * HEAD_DIM, DIM)
        made = (lambda: nn.Linear(heads, heads)) if linear else (lambda: nn.Parameter(torch.randn(heads, heads)))
        self.pre = made() if pre else None
        self.post = made() if post else None
        self.norm = nn.LayerNorm(heads) if norm else None
        self.drop = nn.Dropout(drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attend(x, None)

    def attend(self, x: torch.Tensor, zero: int | None) -> torch.Tensor:
        """The forward; with ``zero``, that head's activations are zeroed where they enter the others (the
        mixing maps' inputs and the projection's input): the masking a removal must equal."""
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.h, HEAD_DIM).permute(2, 0, 3, 1, 4).unbind(0)
        dots = q @ k.transpose(-2, -1) * HEAD_DIM ** -0.5
        if self.pre is not None:
            dots = _mixed(_zeroed(dots, zero, 1), self.pre)
        attn = self.drop(dots.softmax(dim=-1))
        if self.post is not None:
            attn = _mixed(_zeroed(attn, zero, 1), self.post)
        if self.norm is not None:
            attn = self.norm(attn.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        out = (attn @ v).transpose(1, 2)
        return self.proj(_zeroed(out, zero, 2).reshape(b, n, -1))


def _mixed(t: torch.Tensor, m: nn.Parameter | nn.Linear) -> torch.Tensor:
    """The heads (dim 1) of ``t`` mixed by ``m``."""
    if isinstance(m, nn.Linear):
        return m(t.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
    return torch.einsum("bhij,hg->bgij", t, m)


def _zeroed(t: torch.Tensor, head: int | None, dim: int) -> torch.Tensor:
    if head is None:
        return t
    t = t.clone()
    t.select(dim, head).zero_()
    return t


KINDS = {"talking_heads": dict(pre=True, post=True), "pre_only": dict(pre=True, post=False),
         "reattention": dict(pre=False, post=True), "linear_layers": dict(pre=True, post=True, linear=True)}


def build(kind: str, **kw) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, DIM), MixedHeads(**KINDS[kind], **kw), nn.LayerNorm(DIM),
                         nn.Linear(DIM, 3)).double()


def inputs() -> torch.Tensor:
    return torch.randn(2, 4, 5, dtype=torch.double, generator=torch.Generator().manual_seed(1))


def maps(attn: MixedHeads) -> list[torch.Tensor]:
    """Each mixing map as [read head][made head] (a view: writing to it writes the map)."""
    return [m.weight.T if isinstance(m, nn.Linear) else m for m in (attn.pre, attn.post) if m is not None]


def map_slices(attn: MixedHeads) -> list[tuple[str, int, bool]]:
    """(tensor, dim, output) of every mixing map's slice, from the model's layout: the dim that reads a head is an
    output slice, the dim that makes it (and a Linear's bias) is copied."""
    out = []
    for name in ("pre", "post"):
        m = getattr(attn, name)
        if isinstance(m, nn.Linear):
            out += [(f"1.{name}.weight", 1, True), (f"1.{name}.weight", 0, False), (f"1.{name}.bias", 0, False)]
        elif m is not None:
            out += [(f"1.{name}", 0, True), (f"1.{name}", 1, False)]
    return sorted(out)


def head_group(s: Surgeon):
    (g,) = [g for g in s.groups if g.kind == "head"]
    return g


def with_layers(model: nn.Sequential, x: torch.Tensor, zero: int) -> torch.Tensor:
    """The model with head ``zero`` masked at its entry points by the forward itself (no parameter changed)."""
    h = model[1].attend(model[0](x), zero)
    return model[3](model[2](h))


def with_weights(model: nn.Sequential, head: int) -> nn.Sequential:
    """A copy whose parameters mask head ``head``: its rows of the mixing maps (what it adds to the other heads)
    and its columns of the output projection are zero."""
    masked = copy.deepcopy(model)
    with torch.no_grad():
        for m in maps(masked[1]):
            m[head] = 0
        masked[1].proj.weight.view(DIM, -1, HEAD_DIM)[:, head] = 0
    return masked


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_head_owns_its_row_and_column_of_each_map(kind: str) -> None:
    model = build(kind)
    s = Surgeon(model, (inputs(),))
    g = head_group(s)
    assert g.exact and g.count == HEADS
    expected = map_slices(model[1])
    found = sorted((sl.name, sl.dim, sl.output) for sl in g.slices if sl.name.startswith(("1.pre", "1.post")))
    assert found == expected
    assert all(any(n in note and "row and column" in note for note in g.notes) for n, _, out in expected if out)
    assert "row and column" in s.explain()


@pytest.mark.parametrize("kind", list(KINDS))
def test_clones_leave_every_output_unchanged(kind: str) -> None:
    model, x = build(kind), inputs()
    s = Surgeon(model, (x,))
    g = head_group(s)
    with torch.no_grad():
        y0 = model(x)
    gen = torch.Generator().manual_seed(0)
    for parent in (0, 2, 3):
        s.clone(g, parent, noise_std=0.3, generator=gen, relative=True)
    assert [tuple(m.shape) for m in maps(model[1])] == [(HEADS + 3, HEADS + 3)] * len(maps(model[1]))
    with torch.no_grad():
        assert (model(x) - y0).abs().max() < 1e-9


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("head", [0, 1, 2])
def test_removal_equals_masking_at_every_entry_point(kind: str, head: int) -> None:
    model, x = build(kind), inputs()
    original = copy.deepcopy(model)
    s = Surgeon(model, (x,))
    s.remove(head_group(s), head)
    with torch.no_grad():
        removed = model(x)
        assert (removed - with_layers(original, x, head)).abs().max() < 1e-9
        assert (removed - with_weights(original, head)(x)).abs().max() < 1e-9


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_tap_sees_a_head_at_every_point_it_enters_the_others(kind: str) -> None:
    """``tap`` sees a head at each mixing map's input (its logits, its weights) and at the projection's input, so
    zeroing it there equals masking it in the forward, a removal, and the map rows and projection columns zeroed."""
    model, x = build(kind), inputs()
    fresh = copy.deepcopy(model)
    s = Surgeon(model, (x,))
    seen: list[tuple[int, ...]] = []

    def zero_head_1(a: torch.Tensor) -> None:
        seen.append(tuple(a.shape))
        a[..., 1, :].zero_()

    handle = s.tap(head_group(s), zero_head_1)
    with torch.no_grad():
        tapped = model(x)
    handle.remove()
    sites = len(maps(model[1]))
    b, n = x.shape[:2]
    assert sorted(seen) == sorted([(b, n, HEADS, HEAD_DIM)] + [(b, n, n, HEADS, 1)] * sites)
    s2 = Surgeon(fresh, (x,))
    reference = with_layers(fresh, x, 1)
    s2.remove(head_group(s2), 1)
    with torch.no_grad():
        assert (tapped - reference).abs().max() < 1e-9
        assert (tapped - fresh(x)).abs().max() < 1e-9
        assert (tapped - with_weights(model, 1)(x)).abs().max() < 1e-9


def test_adam_state_follows_both_dims_of_a_map() -> None:
    model, x = build("talking_heads"), inputs()
    s = Surgeon(model, (x,))
    g = head_group(s)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    s.attach_optimizer(opt)
    train_steps(model, opt, x)
    pre = model[1].pre
    before = {k: opt.state[pre][k].clone() for k in ("exp_avg", "exp_avg_sq")}
    s.remove(g, 1)
    for k, v in before.items():  # kept rows and columns bit-identical
        assert torch.equal(opt.state[pre][k], v[[0, 2]][:, [0, 2]])
    kept = {k: opt.state[pre][k].clone() for k in before}
    s.clone(g, 0)
    for k, v in kept.items():  # the parent's and the new head's rows and columns start from zero
        now = opt.state[pre][k]
        assert torch.equal(now[1:2, 1:2], v[1:2, 1:2])
        assert not now[[0, 2]].any() and not now[:, [0, 2]].any()
    assert torch.isfinite(train_steps(model, opt, x))


@pytest.mark.parametrize("kind", ["talking_heads", "linear_layers"])
def test_a_layer_left_with_no_heads_still_trains(kind: str) -> None:
    model, x = build(kind), inputs()
    s = Surgeon(model, (x,))
    g = head_group(s)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    s.attach_optimizer(opt)
    train_steps(model, opt, x)
    while g.count:
        s.remove(g, 0)
    assert [tuple(m.shape) for m in maps(model[1])] == [(0, 0), (0, 0)]
    assert torch.isfinite(train_steps(model, opt, x))
    assert model(torch.randn(3, 7, 5, dtype=torch.double)).shape == (3, 7, 3)


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_train_and_eval_behave_like_the_original(mode: str) -> None:
    model, x = build("talking_heads", drop=0.2), inputs()
    original = copy.deepcopy(model)
    s = Surgeon(model, (x,))
    g = head_group(s)
    for m in (model, original):
        getattr(m, mode)()
    # in train mode a clone draws dropout for one more head: the same seed gives other draws
    for edit in [lambda: None] + ([lambda: s.clone(g, 1)] if mode == "eval" else []):
        edit()
        torch.manual_seed(3)
        a = model(x)
        torch.manual_seed(3)
        b = original(x)
        assert (a - b).abs().max() < 1e-9


@pytest.mark.parametrize("kind", ["talking_heads", "linear_layers"])
def test_unit_norms_count_each_element_of_a_map_once(kind: str) -> None:
    model = build(kind)
    s = Surgeon(model, (inputs(),))
    g = head_group(s)
    attn = model[1].requires_grad_(False)
    for h in range(HEADS):
        owned = [attn.qkv.weight.view(3, HEADS, HEAD_DIM, DIM)[:, h], attn.qkv.bias.view(3, HEADS, HEAD_DIM)[:, h],
                 attn.proj.weight.view(DIM, HEADS, HEAD_DIM)[:, h]]
        sq = sum(float(t.square().sum()) for t in owned)
        sq += sum(float(m[h].square().sum() + m[:, h].square().sum() - m[h, h].square()) for m in maps(attn))
        sq += sum(float(m.bias[h].square()) for m in (attn.pre, attn.post) if isinstance(m, nn.Linear))
        assert abs(float(s.unit_norms(g)[h]) ** 2 - sq) < 1e-5 * sq  # the norms are float32


def test_a_layer_norm_over_the_heads_axis_makes_the_group_inexact() -> None:
    """Re-attention normalises the mixed weights over the heads: a removal changes the others' statistics."""
    model, x = build("reattention", norm=True), inputs()
    s = Surgeon(model, (x,))
    g = head_group(s)
    assert not g.exact and any("normalisation" in note for note in g.notes)
    assert {("1.norm.weight", 0), ("1.norm.bias", 0), ("1.post", 0), ("1.post", 1)} <= {(sl.name, sl.dim)
                                                                                       for sl in g.slices}
    s.remove(g, 1)
    s.clone(g, 0)
    assert model[1].norm.weight.shape == (HEADS,) and model(x).shape == (2, 4, 3)


class ComputedMap(MixedHeads):
    """Heads mixed by a map computed from the parameter (its softmax over the input heads)."""

    def attend(self, x: torch.Tensor, zero: int | None) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.h, HEAD_DIM).permute(2, 0, 3, 1, 4).unbind(0)
        dots = torch.einsum("bhij,hg->bgij", q @ k.transpose(-2, -1), self.pre.softmax(0))
        return self.proj((dots.softmax(-1) @ v).transpose(1, 2).reshape(b, n, -1))


class MoreHeads(MixedHeads):
    """Three heads' logits mixed into six heads of weights, each reading a value head of its own."""

    def __init__(self) -> None:
        super().__init__(pre=False, post=False)
        self.pre = nn.Parameter(torch.randn(HEADS, 2 * HEADS))
        self.v = nn.Linear(DIM, 2 * HEADS * HEAD_DIM)
        self.proj = nn.Linear(2 * HEADS * HEAD_DIM, DIM)

    def attend(self, x: torch.Tensor, zero: int | None) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, _ = self.qkv(x).view(b, n, 3, self.h, HEAD_DIM).permute(2, 0, 3, 1, 4).unbind(0)
        v = self.v(x).view(b, n, 2 * self.h, HEAD_DIM).transpose(1, 2)
        dots = torch.einsum("bhij,hg->bgij", q @ k.transpose(-2, -1), self.pre)
        return self.proj((dots.softmax(-1) @ v).transpose(1, 2).reshape(b, n, -1))


@pytest.mark.parametrize("attn, reason", [
    (lambda: ComputedMap(pre=True, post=False), "einsum: 3 heads mixed by a computed map"),
    (MoreHeads, "einsum: 3 heads mixed by a map to 6 heads"),
    (lambda: MixedHeads(pre=True, post=True, heads=1), "einsum: "),
], ids=["computed", "more_heads", "one_head"])
def test_a_mixing_that_cannot_be_sliced_is_refused_naming_its_node(attn, reason: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, DIM), attn(), nn.LayerNorm(DIM), nn.Linear(DIM, 3)).double()
    s = Surgeon(model, (inputs(),))
    assert not [g for g in s.groups if g.kind == "head"]
    assert any(reason in why for lo in s.left_out for why in lo.reasons), s.explain()


def _vit_pytorch(name: str) -> nn.Module:
    pytest.importorskip("vit_pytorch")
    from vit_pytorch.cait import CaiT
    from vit_pytorch.deepvit import DeepViT

    torch.manual_seed(0)
    common = dict(image_size=16, patch_size=8, num_classes=3, dim=16, depth=1, heads=3, mlp_dim=16, dim_head=4)
    built = CaiT(cls_depth=1, **common) if name == "cait" else DeepViT(**common)
    return built.double().eval()


def test_vit_pytorch_cait_talking_heads_are_exact_groups() -> None:
    model = _vit_pytorch("cait")
    x = torch.randn(2, 3, 16, 16, dtype=torch.double)
    original = copy.deepcopy(model)
    s = Surgeon(model, (x,))
    heads = [g for g in s.groups if g.kind == "head"]
    assert len(heads) == 2 and all(g.exact and g.count == 3 for g in heads), s.explain()
    with torch.no_grad():
        y0 = model(x)
        for g in heads:
            s.clone(g, 1, noise_std=0.2, generator=torch.Generator().manual_seed(0), relative=True)
        assert (model(x) - y0).abs().max() < 1e-9
        masked = copy.deepcopy(original)
        for g in heads:  # the library's own names: head 1's rows of both maps and its output columns
            attn = masked.get_submodule(g.module)
            attn.mix_heads_pre_attn[1] = 0
            attn.mix_heads_post_attn[1] = 0
            attn.to_out[0].weight[:, 4:8] = 0
        fresh = copy.deepcopy(original)
        s2 = Surgeon(fresh, (x,))
        for g in s2.groups:
            if g.kind == "head":
                s2.remove(g, 1)
        assert (fresh(x) - masked(x)).abs().max() < 1e-9


def test_vit_pytorch_deepvit_reattention_heads_are_groups() -> None:
    model = _vit_pytorch("deepvit")
    x = torch.randn(2, 3, 16, 16, dtype=torch.double)
    s = Surgeon(model, (x,))
    (g,) = [g for g in s.groups if g.kind == "head"]
    assert g.count == 3 and not g.exact  # its layer norm over the heads axis normalises them together
    assert any("reattn_weights" in note for note in g.notes)
    s.remove(g, 0)
    s.clone(g, 1)
    assert model(x).shape == (2, 3)
