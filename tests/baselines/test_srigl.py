"""SRigL (barter.baselines.srigl): constant fan-in kept by updates, neuron ablation, condensed linear, resume."""
import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from zoo import Style, TinyTransformer

from barter.baselines.srigl import build_srigl, condense, condensed_linear, constant_fan_in_update, top_per_row


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 8), st.integers(2, 10), st.floats(0.05, 1.0), st.floats(0.0, 0.9), st.floats(0.0, 1.0),
       st.integers(0, 2**16))
def test_updates_keep_a_constant_fan_in_and_the_target(rows, cols, density, fraction, gamma, seed):
    g = torch.Generator().manual_seed(seed)
    target = max(rows, int(density * rows * cols))
    mask = top_per_row(torch.rand(rows, cols, generator=g), target // rows)
    weight = torch.randn(rows, cols, generator=g) * mask
    new_mask, new = constant_fan_in_update(weight, mask, torch.rand(rows, cols, generator=g), fraction,
                                           target=target, gamma_sal=gamma)
    fan_in = new_mask.sum(1)
    live = fan_in > 0
    assert live.any()
    assert (fan_in[live] == target // int(live.sum())).all()
    assert int(new_mask.sum()) <= target
    assert not (new & mask).any() and (new <= new_mask).all()
    if gamma == 0:
        assert live.all()


def test_a_neuron_without_salient_weights_is_ablated_and_its_weights_spread_over_the_others():
    w = torch.tensor([[5.0, 4.0, 0.0, 0.0], [0.0, 3.0, 0.5, 0.0], [0.0, 0.0, 2.0, 0.2], [1e-3, 2e-3, 0.0, 0.0]])
    grad = torch.tensor([[0.0, 0.0, 7.0, 6.0], [0.0, 0.0, 0.0, 9.0], [8.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    # drop 4 of 8: salient = top-4 |w| (rows 0-2) and top-4 |grad| (rows 0-2); row 3 has none (< 1 = 0.3 * 2)
    mask, new = constant_fan_in_update(w, w != 0, grad, 0.5, target=8, gamma_sal=0.3)
    assert mask.tolist() == [[True, True, False, False], [False, True, False, True], [True, False, True, False],
                             [False, False, False, False]]  # fan-in 8 // 3 = 2 for the three neurons left
    assert new.tolist() == [[False] * 4, [False, False, False, True], [True, False, False, False], [False] * 4]
    kept, _ = constant_fan_in_update(w, w != 0, grad, 0.5, target=8, gamma_sal=0.0)
    assert (kept.sum(1) == 2).all()  # without ablation row 3 stays, regrown to the fan-in


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 6), st.integers(1, 9), st.integers(1, 9), st.integers(0, 2**16))
def test_condensed_linear_equals_the_masked_dense_product(rows, cols, k, seed):
    k = min(k, cols)
    g = torch.Generator().manual_seed(seed)
    mask = top_per_row(torch.rand(rows, cols, generator=g), k)
    mask[torch.rand(rows, generator=g) < 0.3] = False  # ablated neurons
    weight = torch.randn(rows, cols, generator=g, dtype=torch.float64)
    x, bias = torch.randn(3, 2, cols, generator=g, dtype=torch.float64), torch.randn(rows, dtype=torch.float64)
    dense = torch.nn.functional.linear(x, weight * mask, bias)
    torch.testing.assert_close(condensed_linear(x, condense(weight, mask), bias), dense, rtol=0, atol=1e-12)


def test_condense_rejects_a_mask_without_constant_fan_in():
    with pytest.raises(ValueError, match="constant fan-in"):
        condense(torch.ones(2, 3), torch.tensor([[True, True, False], [True, False, False]]))


def tiny():
    torch.manual_seed(0)
    return TinyTransformer(Style(heads=2, head_dim=4, mlp_hidden=8))


EXAMPLE = (torch.zeros(2, 4, 5),)


def build(model, opt):
    return build_srigl(model, opt, density=0.4, total_steps=40, update_interval=2, gamma_sal=0.9,
                       example_inputs=EXAMPLE)


def train(model, opt, sp, steps, start=0, check=None):
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(step)
        loss = model(torch.randn(4, 4, 5, generator=g)).square().mean()
        loss.backward()
        before = {n: m.clone() for n, m in sp.masks.items()}
        opt.step()
        sp.step()
        if check:
            check(before)
        opt.zero_grad()


def test_srigl_trains_under_constant_fan_in_zeroes_new_moments_and_resumes_identically():
    model = tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sp = build(model, opt)

    def check(before):
        for n, w in sp.weights.items():
            rows = sp.masks[n].sum(1)
            assert (rows[rows > 0] == sp.fan_in()[n]).all() and sp.counts[n] <= sp.targets[n]
            assert sp.counts[n] == int(sp.masks[n].sum()) and (w[sp.masks[n] == 0] == 0).all()
            new = (sp.masks[n] > before[n]).bool()
            for key in ("exp_avg", "exp_avg_sq"):
                assert (opt.state[w][key][new] == 0).all()

    train(model, opt, sp, 6, check=check)
    assert set(sp.ablated_fraction()) == set(sp.weights)
    assert all(0 <= f < 1 for f in sp.ablated_fraction().values())
    saved = copy.deepcopy((model.state_dict(), opt.state_dict(), sp.state_dict()))
    train(model, opt, sp, 4, start=6)
    fresh = tiny()
    opt2 = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    sp2 = build(fresh, opt2)
    fresh.load_state_dict(saved[0])
    opt2.load_state_dict(saved[1])
    sp2.load_state_dict(saved[2])
    train(fresh, opt2, sp2, 4, start=6)
    assert all(torch.equal(sp.masks[n], sp2.masks[n]) for n in sp.masks) and sp.counts == sp2.counts
    for p, q in zip(model.parameters(), fresh.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    name = next(iter(sp.weights))
    x = torch.randn(3, sp.weights[name].shape[1])
    torch.testing.assert_close(condensed_linear(x, sp.condensed(name)), x @ (sp.weights[name] * sp.masks[name]).T)
