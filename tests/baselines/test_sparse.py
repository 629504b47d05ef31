"""RigL / SET baselines (barter.baselines): ERK densities, drop/grow rule, schedule, optimizer protocol, end-to-end."""
import copy
import math

import pytest
import torch

from barter.baselines import (
    DynamicSparse,
    build_sparse,
    cosine_drop_fraction,
    drop_and_grow,
    erk_densities,
    layer_counts,
)
from barter.rebuild import timm_with_models

SHAPES = [(192, 64), (64, 64), (128, 64), (64, 128), (10, 64)]


def build_model():
    torch.manual_seed(0)
    return timm_with_models().create_model("cct_2_3x1_32_tiny")


def batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(2, 3, 32, 32, generator=g), torch.randint(0, 10, (2,), generator=g)


def train_step(model, opt, sp, step):
    x, y = batch(step)
    torch.manual_seed(step)  # stochastic depth
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    sp.step()
    opt.zero_grad()
    return loss.item()


@pytest.mark.parametrize("density", [0.05, 0.3, 0.5, 0.9, 1.0])
def test_erk_densities_sum_to_the_requested_density(density):
    sizes = [math.prod(s) for s in SHAPES]
    d = erk_densities(SHAPES, density)
    assert all(0 < x <= 1 for x in d)
    assert sum(x * n for x, n in zip(d, sizes)) == pytest.approx(density * sum(sizes))
    counts = layer_counts(SHAPES, density)
    assert sum(counts) == round(density * sum(sizes))
    assert all(abs(c - x * n) < 1 for c, x, n in zip(counts, d, sizes))


def test_erk_makes_a_layer_dense_instead_of_exceeding_one():
    shapes = [(4, 4), (512, 512)]  # raw density of the small layer is 64x that of the large one
    d = erk_densities(shapes, 0.3)
    assert d[0] == 1.0 and d[1] < 0.3
    assert d[1] * 512 * 512 + 16 == pytest.approx(0.3 * (16 + 512 * 512))
    ratio = erk_densities([(64, 64), (128, 64)], 0.3)
    assert ratio[0] / ratio[1] == pytest.approx((128 / 4096) / (192 / 8192))


def test_cosine_drop_fraction():
    assert cosine_drop_fraction(0, 0.3, 750) == pytest.approx(0.3)
    assert cosine_drop_fraction(375, 0.3, 750) == pytest.approx(0.15)
    assert cosine_drop_fraction(750, 0.3, 750) == pytest.approx(0.0)
    model = build_model()
    sp = build_sparse(model, torch.optim.Adam(model.parameters()), total_steps=1000)
    assert sp.end_step == 750
    assert [s for s in range(1, 1001) if sp.is_update_step(s)] == list(range(100, 750, 100))
    assert sp.drop_fraction(200) == pytest.approx(0.15 * (1 + math.cos(math.pi * 200 / 750)))


def test_rigl_grows_at_the_largest_gradients_of_a_hand_built_layer():
    w = torch.tensor([[5.0, 0.0, 1.0, 0.0], [4.0, 0.0, 3.0, 2.0]])
    mask = w != 0                                       # 5 active
    g = torch.tensor([[9.0, 8.0, 0.5, 1.0], [9.0, 7.0, 0.1, 6.0]])
    new_mask, new = drop_and_grow(w, mask, g, 0.4)      # drop 2: |w| = 1 and 2; grow 2 of the largest |g| elsewhere
    assert new_mask.sum() == 5
    assert new_mask.tolist() == [[True, True, False, False], [True, True, True, False]]
    assert new.tolist() == [[False, True, False, False], [False, True, False, False]]


def test_rigl_update_of_a_hand_built_layer_drops_by_the_cosine_schedule_and_grows_by_the_dense_gradient():
    """One layer, loss (w * G).sum() so the gradient is G everywhere. Updates every 4 of 8 steps (end 8): at step 4
    the drop fraction is 0.5 / 2 * (1 + cos(pi / 2)) = 0.25 of the 8 active weights, i.e. the 2 smallest |w|.
    Growth must see the dense gradient: the inactive positions of largest |G|, not the just-dropped ones that a
    masked gradient would leave as the only non-zero scores. The update replaces the optimizer step."""
    values = torch.tensor([[5.0, 0.0, 1.0, 0.0, 4.0, 0.5], [3.0, 0.0, 2.0, 0.0, 6.0, 7.0]])
    g = torch.tensor([[0.0, 9.0, 0.1, 2.0, 0.0, 0.2], [0.0, 1.0, 0.0, 8.0, 0.0, 0.0]])
    w = torch.nn.Parameter(values.clone())
    opt = torch.optim.Adam([w], lr=0.01)
    sp = DynamicSparse({"w": w}, {"w": 8}, opt, method="rigl", total_steps=8, update_interval=4, end_fraction=1.0,
                       drop_fraction=0.5, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        w.copy_(values)  # the hand-built layer replaces the random initial mask
    sp.masks["w"] = (values != 0).float()
    for _ in range(3):
        (w * g).sum().backward()
        opt.step()
        sp.step()
        opt.zero_grad()
    assert sp.is_update_step(4) and sp.drop_fraction(4) == pytest.approx(0.25)
    opt.state[w]["exp_avg"].fill_(1.0)  # moments left over where weights were once active must not survive a regrow
    before = w.detach().clone()
    (w * g).sum().backward()
    opt.step()
    sp.step()
    mask = sp.masks["w"].bool()
    assert mask.tolist() == [[True, True, False, False, True, False], [True, False, True, True, True, True]]
    assert torch.equal(w[mask & (before != 0)], before[mask & (before != 0)])  # kept weights: no optimizer step
    new = mask & (before == 0)
    assert (w[new] == 0).all() and (w[~mask] == 0).all()
    assert (opt.state[w]["exp_avg"][new] == 0).all() and (opt.state[w]["exp_avg_sq"][new] == 0).all()
    assert (opt.state[w]["exp_avg"][mask & ~new] == 1).all()


def test_a_just_dropped_weight_may_be_regrown_and_is_not_new():
    w = torch.tensor([1.0, 2.0, 0.0, 0.0])
    new_mask, new = drop_and_grow(w, w != 0, torch.tensor([9.0, 0.0, 1.0, 2.0]), 0.5)
    assert new_mask.tolist() == [True, True, False, False] and not new.any()


def test_set_grows_only_at_inactive_positions():
    model = build_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sp = build_sparse(model, opt, method="set", density=0.3, total_steps=40, seed=1, update_interval=10)
    before = {n: m.bool().clone() for n, m in sp.masks.items()}
    for step in range(1, 11):
        train_step(model, opt, sp, step)
    for n, m in sp.masks.items():
        grown = m.bool() & ~before[n]
        dropped = before[n] & ~m.bool()
        assert grown.sum() == dropped.sum() > 0
        assert int(m.sum()) == sp.counts[n]


@pytest.mark.parametrize("optim", ["adam", "sgd"])
def test_regrown_weights_and_moments_are_zero_and_the_update_replaces_the_step(optim):
    model = build_model()
    params = list(model.parameters())
    opt = (torch.optim.AdamW(params, lr=1e-3) if optim == "adam"
           else torch.optim.SGD(params, lr=1e-2, momentum=0.9))
    sp = build_sparse(model, opt, method="rigl", density=0.3, total_steps=40, seed=0, update_interval=10)
    for step in range(1, 10):
        train_step(model, opt, sp, step)
    assert sp.is_update_step(10)
    dense = {n: p.detach().clone() for n, p in model.named_parameters() if n not in sp.weights}
    state = {n: {k: v.clone() if torch.is_tensor(v) else v for k, v in opt.state[p].items()}
             for n, p in model.named_parameters()}
    old = {n: m.bool().clone() for n, m in sp.masks.items()}
    train_step(model, opt, sp, 10)
    for n, p in model.named_parameters():
        if n in dense:  # the update replaced the optimizer step: dense parameters and their state unchanged
            assert torch.equal(p, dense[n])
            assert all(torch.equal(v, state[n][k]) if torch.is_tensor(v) else v == state[n][k]
                       for k, v in opt.state[p].items())
    for n, w in sp.weights.items():
        new = sp.masks[n].bool() & ~old[n]
        assert new.any() and int(sp.masks[n].sum()) == sp.counts[n]
        assert (w[new] == 0).all()
        for v in opt.state[w].values():
            if torch.is_tensor(v) and v.shape == w.shape:
                assert (v[new] == 0).all()
                assert (v[~sp.masks[n].bool() & ~old[n]] == 0).all()  # masked gradients: never-active moments stay 0


@pytest.mark.parametrize("method", ["rigl", "set"])
def test_end_to_end_counts_and_zeros_after_every_step(method):
    model = build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
    sp = build_sparse(model, opt, method=method, density=0.5, total_steps=24, seed=0, update_interval=4)
    assert set(sp.weights) == {f"blocks.{i}.{m}.weight" for i in range(2)
                               for m in ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")}
    assert sp.density == pytest.approx(0.5, abs=1e-4)
    masks_seen = []
    for step in range(1, 25):
        loss = train_step(model, opt, sp, step)
        assert math.isfinite(loss)
        for n, w in sp.weights.items():
            assert int(sp.masks[n].sum()) == sp.counts[n]
            assert (w[sp.masks[n] == 0] == 0).all()
        masks_seen.append({n: m.clone() for n, m in sp.masks.items()})
    changed = [s + 1 for s in range(1, 24) if any(not torch.equal(masks_seen[s][n], masks_seen[s - 1][n])
                                                  for n in sp.masks)]
    assert changed == [4, 8, 12, 16]  # every 4 steps while step < 0.75 * 24


def test_resume_restores_masks_and_schedule():
    model = build_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sp = build_sparse(model, opt, method="set", density=0.3, total_steps=40, update_interval=4)
    for step in range(1, 7):
        train_step(model, opt, sp, step)
    sd_sp, sd_model, sd_opt = copy.deepcopy((sp.state_dict(), model.state_dict(), opt.state_dict()))
    fresh = build_model()
    opt2 = torch.optim.Adam(fresh.parameters(), lr=1e-3)
    sp2 = build_sparse(fresh, opt2, method="set", density=0.3, total_steps=40, update_interval=4)
    sp2.load_state_dict(sd_sp)
    fresh.load_state_dict(sd_model)
    opt2.load_state_dict(sd_opt)
    for step in range(7, 12):
        train_step(model, opt, sp, step)
        train_step(fresh, opt2, sp2, step)
    assert all(torch.equal(sp.masks[n], sp2.masks[n]) for n in sp.masks)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))


def test_step_without_optimizer_step_is_an_error():
    model = build_model()
    sp = build_sparse(model, torch.optim.Adam(model.parameters()), total_steps=10)
    with pytest.raises(RuntimeError):
        sp.step()
