"""SNFS (barter.baselines.snfs): redistribution, hand-built prune/regrow by momentum, optimizer checks, resume."""
import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from zoo import Style, TinyTransformer

from barter.baselines.snfs import SparseMomentum, build_snfs, cosine_prune_rate, optimizer_momentum, redistribute


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 10), st.integers(0, 50)), min_size=1, max_size=6), st.integers(0, 200))
def test_redistribute_splits_exactly_under_capacities(layers, total):
    shares, caps = [s for s, _ in layers], [c for _, c in layers]
    parts = redistribute(shares, total, caps)
    assert sum(parts) == min(total, sum(caps))
    assert all(0 <= p <= c for p, c in zip(parts, caps))


def test_redistribute_follows_shares_and_spills_over_a_full_layer():
    assert redistribute([0.75, 0.25], 8, [10, 10]) == [6, 2]
    assert redistribute([0.75, 0.25], 8, [3, 10]) == [3, 5]


def test_prune_rate_decays_by_cosine_to_its_floor():
    assert cosine_prune_rate(0, 0.5, 0.005, 100) == pytest.approx(0.5)
    assert cosine_prune_rate(50, 0.5, 0.005, 100) == pytest.approx(0.2525)
    assert cosine_prune_rate(100, 0.5, 0.005, 100) == pytest.approx(0.005)


def hand_driver():
    """Two 2x4 layers with 4 active weights each; SGD with lr 0, so the first step's momentum is the gradient."""
    values = {"a": torch.tensor([[4.0, 3.0, 0.0, 0.0], [2.0, 1.0, 0.0, 0.0]]),
              "b": torch.tensor([[0.0, 0.0, 4.0, 3.0], [0.0, 0.0, 2.0, 1.0]])}
    a, b = (torch.nn.Parameter(torch.zeros(2, 4)) for _ in range(2))
    opt = torch.optim.SGD([a, b], lr=0.0, momentum=0.9)
    sp = SparseMomentum({"a": a, "b": b}, {"a": 4, "b": 4}, opt, total_steps=10, update_interval=1, end_fraction=1.0,
                        prune_rate=0.5, min_prune_rate=0.5, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # the driver's own random masks replaced by the hand-built ones
        for name, w in (("a", a), ("b", b)):
            w.copy_(values[name])
            sp.masks[name] = (w != 0).float()
    # mean |momentum| over active weights: a 3, b 1 -> a regrows 3 of the 4 dropped, b 1
    a.grad = torch.tensor([[3.0, 3.0, 9.0, 1.0], [3.0, 3.0, 8.0, 7.0]])
    b.grad = torch.tensor([[5.0, 0.5, 1.0, 1.0], [0.2, 0.1, 1.0, 1.0]])
    return sp, opt, a, b


def test_snfs_prunes_by_magnitude_and_regrows_by_momentum_across_layers():
    sp, opt, a, b = hand_driver()
    opt.step()
    sp.step()
    # each layer drops ceil(0.5 * 4) = 2 smallest |w|; a grows 3 at its largest inactive momenta, b grows 1
    assert sp.masks["a"].bool().tolist() == [[True, True, True, False], [False, False, True, True]]
    assert sp.masks["b"].bool().tolist() == [[True, False, True, True], [False, False, False, False]]
    assert sp.counts == {"a": 5, "b": 3}
    new_a, new_b = torch.tensor([[0, 0, 1, 0], [0, 0, 1, 1]]).bool(), torch.tensor([[1, 0, 0, 0], [0, 0, 0, 0]]).bool()
    assert (a[new_a] == 0).all() and (b[new_b] == 0).all()
    assert (opt.state[a]["momentum_buffer"][new_a] == 0).all()
    assert (opt.state[b]["momentum_buffer"][new_b] == 0).all()
    assert opt.state[a]["momentum_buffer"][0, 0] == 3.0  # kept weights keep their momentum


def test_adam_momentum_is_the_normalised_first_moment():
    w = torch.nn.Parameter(torch.randn(3, 3))
    opt = torch.optim.Adam([w])
    with pytest.raises(RuntimeError, match="momentum"):
        optimizer_momentum(opt, w)
    w.grad = torch.randn(3, 3)
    opt.step()
    s = opt.state[w]
    torch.testing.assert_close(optimizer_momentum(opt, w), s["exp_avg"] / (s["exp_avg_sq"].sqrt() + 1e-8))


def tiny():
    torch.manual_seed(0)
    return TinyTransformer(Style(heads=2, head_dim=4, mlp_hidden=8))


EXAMPLE = (torch.zeros(2, 4, 5),)


def test_snfs_needs_an_optimizer_with_momentum():
    model = tiny()
    with pytest.raises(ValueError, match="momentum"):
        build_snfs(model, torch.optim.SGD(model.parameters(), lr=0.1), total_steps=10, example_inputs=EXAMPLE)


def train(model, opt, sp, steps, start=0):
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(step)
        loss = model(torch.randn(4, 4, 5, generator=g)).square().mean()
        loss.backward()
        opt.step()
        sp.step()
        opt.zero_grad()


def test_snfs_holds_the_total_count_and_resumes_identically():
    model = tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sp = build_snfs(model, opt, density=0.3, total_steps=20, update_interval=2, example_inputs=EXAMPLE)
    total = sum(sp.counts.values())
    train(model, opt, sp, 6)
    assert sum(sp.counts.values()) == total
    assert all(int(sp.masks[n].sum()) == c for n, c in sp.counts.items())
    assert all((w[sp.masks[n] == 0] == 0).all() for n, w in sp.weights.items())
    saved = copy.deepcopy((model.state_dict(), opt.state_dict(), sp.state_dict()))
    train(model, opt, sp, 4, start=6)
    fresh = tiny()
    opt2 = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    sp2 = build_snfs(fresh, opt2, density=0.3, total_steps=20, update_interval=2, example_inputs=EXAMPLE)
    fresh.load_state_dict(saved[0])
    opt2.load_state_dict(saved[1])
    sp2.load_state_dict(saved[2])
    assert sp2.counts == {n: int(m.sum()) for n, m in sp2.masks.items()}
    train(fresh, opt2, sp2, 4, start=6)
    assert all(torch.equal(sp.masks[n], sp2.masks[n]) for n in sp.masks)
    for p, q in zip(model.parameters(), fresh.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
