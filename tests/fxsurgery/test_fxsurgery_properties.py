"""Properties of fxsurgery on tiny transformers drawn by hypothesis: clones preserve outputs, removals
equal masking, optimizer state follows every edit. Examples are drawn afresh each run (the seed is
printed at the end); ``tests/conftest.py`` holds the profiles (``make soak`` draws 1,000 per test)."""
from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from zoo import Style, TinyTransformer, masked_copy, train_steps

from fxsurgery import Surgeon

EXAMPLES = settings.default.max_examples  # per test, from the loaded profile

styles = st.builds(
    Style,
    heads=st.integers(1, 6),
    head_dim=st.integers(1, 6),
    mlp_hidden=st.integers(1, 9),
    depth=st.integers(1, 3),
    projection=st.sampled_from(["fused", "fused_chunk", "fused_split", "head_major", "separate"]),
    product=st.sampled_from(["sdpa", "matmul", "einsum"]),
    merge=st.sampled_from(["reshape_minus1", "flatten", "reshape_c", "head_minor"]),
    activation=st.sampled_from(["gelu", "relu", "silu", "tanh"]),
    qkv_bias=st.booleans(),
)


def build(style: Style, seed: int = 0) -> tuple[TinyTransformer, torch.Tensor]:
    torch.manual_seed(seed)
    model = TinyTransformer(style).double()
    return model, torch.randn(3, 6, 5, dtype=torch.double)


def expected_outputs(model: TinyTransformer, style: Style) -> list[str]:
    """Output weights of the layers that must be groups: every FFN, and every attention but one of a single
    head of a single coordinate (its q/k/v split is ``(.., 1, 1)``: which size-1 dim is the head cannot be told)."""
    return [name for name in model.UNIT_COLUMNS if not _one_by_one(style) or "attn" not in name]


def _one_by_one(style: Style) -> bool:
    return style.heads == 1 and style.head_dim == 1


def assert_single_heads_reported(s: Surgeon, style: Style) -> None:
    """A layer of one head of one coordinate is left out with its reason at its own module."""
    if _one_by_one(style):
        told = {lo.module for lo in s.left_out if lo.reasons}
        assert {f"blocks.{i}.attn" for i in range(style.depth)} <= told


def layer_groups(s: Surgeon) -> dict[str, object]:
    """Output weight name -> group, found through the group's sliced tensors."""
    out = {}
    for g in s.groups:
        for sl in g.slices:
            if sl.output:
                out[sl.name] = g
    return out


def remove_random_unit(s: Surgeon, groups: dict, alive: dict[str, list[int]], data: st.DataObject) -> None:
    """Remove a drawn unit of a drawn group (unless it is at its minimum); ``alive`` tracks the survivors."""
    name = data.draw(st.sampled_from(sorted(groups)))
    g = groups[name]
    if g.count > g.min_count:
        alive[name].pop(j := data.draw(st.integers(0, g.count - 1)))
        s.remove(g, j)


def dead_units(groups: dict, alive: dict[str, list[int]]) -> dict[str, set[int]]:
    return {n: set(range(groups[n].max_count)) - set(a) for n, a in alive.items()}


def assert_masked_then_clones_exact(s: Surgeon, original: torch.nn.Module, x: torch.Tensor, groups: dict,
                                    alive: dict[str, list[int]], width: dict[str, int] | None,
                                    data: st.DataObject) -> None:
    """The operated model equals ``original`` with the removed units masked (``masked_copy``'s columns);
    drawn clones keep its outputs."""
    with torch.no_grad():
        y0 = s.model(x)
        assert (y0 - masked_copy(original, dead_units(groups, alive), width)(x)).abs().max().item() <= 1e-9
        for g in s.groups:
            if g.count:
                s.clone(g, data.draw(st.integers(0, g.count - 1)), noise_std=0.1)
        assert (s.model(x) - y0).abs().max().item() <= 1e-9


@given(style=styles, data=st.data())
def test_clone_preserves_outputs(style: Style, data: st.DataObject) -> None:
    model, x = build(style)
    s = Surgeon(model, (x,))
    assert len(s.groups) == len(expected_outputs(model, style))
    assert_single_heads_reported(s, style)
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 100)))
    for mode in ("train", "eval"):
        getattr(model, mode)()
        with torch.no_grad():
            y0 = model(x)
        for _ in range(3):
            g = data.draw(st.sampled_from(s.groups))
            parent = data.draw(st.integers(0, g.count - 1))
            noise = data.draw(st.sampled_from([0.0, 0.01, 1.0]))
            before = g.count
            new = s.clone(g, parent, noise_std=noise, generator=gen)
            assert new == before and g.count == before + 1
            with torch.no_grad():
                y1 = model(x)
            assert (y1 - y0).abs().max().item() <= 1e-9 * max(1.0, y0.abs().max().item())


@given(style=styles, data=st.data())
def test_removals_equal_masking(style: Style, data: st.DataObject) -> None:
    model, x = build(style)
    model.eval()
    original = copy.deepcopy(model)
    s = Surgeon(model, (x,))
    groups = layer_groups(s)
    assert sorted(groups) == sorted(expected_outputs(model, style))
    assert_single_heads_reported(s, style)
    alive = {name: list(range(g.count)) for name, g in groups.items()}
    for _ in range(data.draw(st.integers(1, 8))):
        remove_random_unit(s, groups, alive, data)
        ref = masked_copy(original, dead_units(groups, alive))
        with torch.no_grad():
            assert (model(x) - ref(x)).abs().max().item() <= 1e-9


def _dense_state(opt: torch.optim.Optimizer, p: torch.Tensor) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in opt.state[p].items() if torch.is_tensor(v) and v.dim() > 0}


@pytest.mark.parametrize("make_opt", [
    lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=True),
    lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=False, amsgrad=True),
    lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
], ids=["adam-foreach", "adamw-single-amsgrad", "sgd-momentum"])
@settings(max_examples=max(1, EXAMPLES // 3) if settings.get_current_profile_name() == "ci" else EXAMPLES)
@given(style=styles, data=st.data())
def test_optimizer_state_follows_edits(make_opt, style: Style, data: st.DataObject) -> None:
    model, x = build(style)
    model.float()
    x = x.float()
    opt = make_opt(model.parameters())
    s = Surgeon(model, (x,))
    s.attach_optimizer(opt)
    train_steps(model, opt, x)
    for _ in range(data.draw(st.integers(1, 5))):
        g = data.draw(st.sampled_from(s.groups))
        sl = next(sl for sl in g.slices if sl.output)
        p = model.get_parameter(sl.name)
        old = _dense_state(opt, p)
        scalars = {k: v for k, v in opt.state[p].items() if not (torch.is_tensor(v) and v.dim() > 0)}
        n = g.count
        if data.draw(st.booleans()) and g.count > g.min_count:
            j = data.draw(st.integers(0, n - 1))
            s.remove(g, j)
            keep = [u for u in range(n) if u != j]
            for k, v in old.items():
                assert torch.equal(opt.state[p][k], sl.keep(v, n, torch.tensor(keep, dtype=torch.long)))
        elif g.count:
            parent = data.draw(st.integers(0, n - 1))
            new = s.clone(g, parent, noise_std=0.01)
            others = torch.tensor([u for u in range(n) if u != parent], dtype=torch.long)
            for k, v in old.items():
                st_now = opt.state[p][k]
                assert sl.unit(st_now, n + 1, parent).abs().max() == 0
                assert sl.unit(st_now, n + 1, new).abs().max() == 0
                assert torch.equal(sl.keep(st_now, n + 1, others), sl.keep(v, n, others))
        for k, v in scalars.items():
            assert torch.equal(torch.as_tensor(opt.state[p][k]), torch.as_tensor(v))
        for name, q in model.named_parameters():
            for k, v in opt.state[q].items():
                if torch.is_tensor(v) and v.dim() > 0:
                    assert v.shape == q.shape, f"{name}.{k}"
    opt.zero_grad()
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    assert torch.isfinite(loss)
