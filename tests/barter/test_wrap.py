"""barter.wrap on a small timm ViT: schedule, exact transfers, budgets, hooks, determinism and resume."""
import copy

import pytest
import torch

import barter

timm = pytest.importorskip("timm")
T = 120


def build(depth=4):
    torch.manual_seed(0)
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=5, img_size=32, patch_size=8,
                             depth=depth, mlp_ratio=1.0)


def mask_donors(model, events):
    """Zero each event's donor output slice in `model` (timm ViT names; head_dim 64); returns `model`."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for e in events:
            if e["kind"] == "head":
                params[f"{e['donor_layer']}.proj.weight"][:, 64 * e["donor_index"]:64 * (e["donor_index"] + 1)] = 0
            else:
                params[f"{e['donor_layer']}.fc2.weight"][:, e["donor_index"]] = 0
    return model


def batch(step):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, 5, (8,), generator=g)


def train(ctl, opt, steps, on_step=None):
    for step in steps:
        x, y = batch(step)
        ctl.model.train()
        loss = torch.nn.functional.cross_entropy(ctl.model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if on_step is not None:
            on_step(step, loss)


def new(method="barter", seed=0, auto=True, total=T, **kw):
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.05)
    return barter.wrap(model, opt, total_steps=total, density=0.5, method=method, seed=seed, auto=auto, **kw), opt


def total(topology, kind):
    return sum(v.get(kind, 0) for v in topology.values())


@pytest.fixture(scope="module")
def manual_run():
    """One manual (auto=False) run checking every transfer; returns (ctl, per-step records).

    A transfer removes the donor, which changes the outputs exactly as zeroing the donor's output slice
    would, and clones the parent, which changes nothing: so the outputs right after it must equal those of
    the model right before it with the donor's output slice zeroed.
    """
    ctl, opt = new(auto=False)
    xfix = torch.randn(4, 3, 32, 32)
    records = {"diffs": [], "losses": [], "topo0": ctl.topology(), "scores_at_end": None}

    def on_step(step, loss):
        records["losses"].append(loss.item())
        n = len(ctl.events)
        ctl.model.eval()
        snapshot = copy.deepcopy(ctl.model)
        for m in snapshot.modules():
            m._forward_pre_hooks.clear()  # the copied score taps would read the live unit counts
        ctl.step()
        done = [e for e in ctl.events[n:] if e["skipped"] is None]
        if done:
            assert len({e["kind"] for e in done}) == len(done)  # one per kind and step: indices stay valid
            with torch.no_grad():
                before = mask_donors(snapshot, done)(xfix)
                after = ctl.model(xfix)
            records["diffs"].append(((after - before).abs().max() / before.abs().max()).item())
        if step == max(max(v) for v in ctl.schedule.values()):
            records["scores_at_end"] = {k: ctl.scores(k) for k in ("head", "channel")}

    train(ctl, opt, range(1, T + 1), on_step=on_step)
    return ctl, records


def test_compact_initialisation(manual_run):
    ctl, rec = manual_run
    for module, kinds in rec["topo0"].items():
        assert kinds in ({"head": 2}, {"channel": 96}), (module, kinds)  # rnd(0.5*3)=2, rnd(0.5*192)=96
    assert len(rec["topo0"]) == 8


def test_attempts_follow_schedule(manual_run):
    ctl, _ = manual_run
    # H = 8 -> K_H = max(1, rnd(0.47)) = 1 at the midpoint 30; C = 384 -> K_C = rnd(21.6) = 22 in 12..48
    assert ctl.schedule["head"] == [30]
    assert ctl.schedule["channel"] == [14, 15, 17, 19, 20, 22, 23, 25, 27, 28, 30, 32, 33, 35, 37, 38, 40, 41, 43,
                                       45, 46, 48]
    assert [(e["step"], e["kind"]) for e in ctl.events if e["kind"] == "head"] == [(30, "head")]
    assert sorted(e["step"] for e in ctl.events if e["kind"] == "channel") == ctl.schedule["channel"]


def test_transfers_preserve_outputs_and_budgets(manual_run):
    ctl, rec = manual_run
    executed = [e for e in ctl.events if e["skipped"] is None]
    assert executed and len(rec["diffs"]) > 0
    assert max(rec["diffs"]) <= 1e-5
    topo = ctl.topology()
    assert topo != rec["topo0"]
    for kind in ("head", "channel"):
        assert total(topo, kind) == total(rec["topo0"], kind)
    assert all(torch.isfinite(torch.tensor(rec["losses"])))
    for e in executed:
        assert e["donor_layer"] != e["receiver_layer"]


def test_hooks_gone_after_window(manual_run):
    ctl, rec = manual_run
    for kind in ("head", "channel"):
        now = ctl.scores(kind)
        for name, (D, S) in rec["scores_at_end"][kind].items():
            assert torch.equal(now[name][0], D) and torch.equal(now[name][1], S), name
        assert all(D.abs().sum() > 0 for D, _ in now.values() if len(D))


def test_same_seed_same_events_auto_equals_manual(manual_run):
    ctl, _ = manual_run
    auto, opt = new(auto=True)
    train(auto, opt, range(1, 50))
    assert auto.events == ctl.events
    other, opt = new(auto=True, seed=1, method="random_pair")
    train(other, opt, range(1, 50))
    assert len(other.events) == len(ctl.events) and other.events != ctl.events


def test_resume_is_bit_identical():
    ref, opt = new(total=60)
    train(ref, opt, range(1, 61))

    run, opt = new(total=60)
    train(run, opt, range(1, 16))  # window 6..24: stop mid-window
    saved = copy.deepcopy((run.model.state_dict(), opt.state_dict(), run.state_dict()))

    fresh, opt2 = new(total=60)
    fresh.load_state_dict(saved[2])  # first: restores the topology so the tensors below fit
    fresh.model.load_state_dict(saved[0])
    opt2.load_state_dict(saved[1])
    train(fresh, opt2, range(16, 61))
    assert fresh.events == ref.events
    assert any(e["step"] > 15 and e["skipped"] is None for e in ref.events)
    for (n1, p1), (n2, p2) in zip(ref.model.named_parameters(), fresh.model.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2), n1


@pytest.mark.parametrize("kw,err", [
    (dict(density=0.0), ValueError), (dict(density=1.5), ValueError),
    (dict(method="nope"), ValueError), (dict(bogus=1), TypeError),
])
def test_bad_arguments(kw, err):
    with pytest.raises(err):
        barter.wrap(build(depth=2), total_steps=10, **kw)


def test_static_never_transfers_and_has_no_schedule():
    ctl, opt = new(method="static", total=20)
    train(ctl, opt, range(1, 21))
    assert ctl.schedule == {"head": [], "channel": []} and ctl.events == []


def test_optimizer_state_that_cannot_be_resized_is_refused():
    from fxsurgery import OptimizerStateError

    model = build(depth=2)
    opt = torch.optim.Adafactor(model.parameters(), lr=1e-3)
    torch.nn.functional.cross_entropy(model(batch(0)[0]), batch(0)[1]).backward()
    opt.step()  # Adafactor keeps factored row/column statistics, not one value per weight
    with pytest.raises(OptimizerStateError, match="Adafactor"):
        barter.wrap(model, opt, total_steps=10)


def test_an_optimizer_of_another_model_or_of_some_parameters_is_refused_naming_what_it_lacks():
    model = build(depth=2)
    with pytest.raises(ValueError, match=r"does not step \d+ of the wrapped model's trainable parameters"):
        barter.wrap(model, torch.optim.SGD(build(depth=2).parameters(), lr=0.1), total_steps=10)
    model = build(depth=2)
    head_only = torch.optim.SGD(model.head.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"blocks\.0\."):
        barter.wrap(model, head_only, total_steps=10)
    ctl = barter.wrap(build(depth=2), total_steps=10)
    with pytest.raises(ValueError, match="does not step"):
        ctl.attach_optimizer(torch.optim.SGD(ctl.model.head.parameters(), lr=0.1))


@pytest.mark.parametrize("make", [
    lambda params: torch.optim.LBFGS(params),
    lambda params: torch.optim.SparseAdam(params),
])
def test_an_optimizer_whose_state_surgery_cannot_follow_is_refused_with_the_supported_list(make):
    from fxsurgery import OptimizerStateError

    model = build(depth=2)
    optimizer = make(list(model.parameters()))
    with pytest.raises(OptimizerStateError, match=rf"{type(optimizer).__name__}.*supported: SGD, Adam"):
        barter.wrap(model, optimizer, total_steps=10)


def test_a_custom_optimizer_with_state_of_another_layout_is_refused_and_one_shaped_like_its_parameters_accepted():
    from fxsurgery import OptimizerStateError

    class History(torch.optim.Optimizer):
        """Keeps per-parameter tensors under its own key: a list, or tensors shaped like the parameter."""
        def __init__(self, params, as_list):
            super().__init__(params, {"lr": 0.1})
            self.as_list = as_list

        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        trace = torch.zeros_like(p)
                        self.state[p]["trace"] = [trace] if self.as_list else trace
                        p.data.add_(p.grad, alpha=-group["lr"])

    for as_list in (True, False):
        model = build(depth=2)
        optimizer = History(model.parameters(), as_list)
        x, y = batch(0)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        if as_list:
            with pytest.raises(OptimizerStateError, match=r"'trace' has a list of tensors.*supported: SGD"):
                barter.wrap(model, optimizer, total_steps=10)
        else:
            ctl = barter.wrap(model, optimizer, total_steps=10)
            width = {n: p.shape for n, p in ctl.model.named_parameters()}
            assert all(optimizer.state[p]["trace"].shape == width[n] for n, p in ctl.model.named_parameters()
                       if p in optimizer.state)


def test_wrapping_a_wrapped_model_says_so_and_how_to_start_over():
    ctl = barter.wrap(build(depth=2), total_steps=10)
    with pytest.raises(ValueError, match=r"wrapped by barter.wrap already.*ctl.close\(\).*build the model afresh"):
        barter.wrap(ctl.model, total_steps=10)


def test_magnitude_init_keeps_the_largest_units():
    from fxsurgery import Surgeon

    model = build(depth=2)
    dense = Surgeon(copy.deepcopy(model), example_inputs=(batch(0)[0],))
    norms = {g.name: dense.unit_norms(g) for g in dense.groups}
    ctl = barter.wrap(model, total_steps=10, init="magnitude")
    for g in ctl.surgeon.groups:
        top = norms[g.name].sort(descending=True).values[:g.count]
        torch.testing.assert_close(ctl.surgeon.unit_norms(g).sort(descending=True).values, top)


def test_a_layer_whose_tap_did_not_run_is_an_error_not_a_zero_score():
    """A host whose forward no longer runs the installed graph (here: its class forward put back) is never
    tapped; the controller refuses to choose on its zero scores, naming the layer."""
    ctl, opt = new()
    bypassed = ctl.model.blocks[1].mlp
    bypassed.forward = type(bypassed).forward.__get__(bypassed)
    x, y = batch(0)
    torch.nn.functional.cross_entropy(ctl.model(x), y).backward()
    with pytest.raises(RuntimeError, match=r"blocks\.1\.mlp:channel did not run"):
        opt.step()


def test_reading_one_kinds_scores_before_the_step_is_no_missing_tap():
    """`ctl.scores(kind)` folds that kind's pending scores; the step still knows its layers were tapped, and still
    refuses a layer that was not."""
    ctl, opt = new()
    x, y = batch(0)
    torch.nn.functional.cross_entropy(ctl.model(x), y).backward()
    assert all(float(d.abs().sum()) > 0 for d, _ in ctl.scores("head").values())
    opt.step()
    assert ctl.step_count == 1
    bypassed = ctl.model.blocks[1].mlp
    bypassed.forward = type(bypassed).forward.__get__(bypassed)
    torch.nn.functional.cross_entropy(ctl.model(x), y).backward()
    ctl.scores("channel")
    with pytest.raises(RuntimeError, match=r"blocks\.1\.mlp:channel did not run"):
        opt.step()


class TwoConvolutions(torch.nn.Module):
    """A small CNN whose two channel groups (c1's 8, c2's 16) are both hosted at the root module ''."""

    def __init__(self):
        super().__init__()
        self.c1, self.c2 = torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.Conv2d(8, 16, 3, padding=1)
        self.c3 = torch.nn.Conv2d(16, 4, 1)

    def forward(self, x):
        return self.c3(torch.relu(self.c2(torch.relu(self.c1(x))))).mean((2, 3))


def test_topology_and_events_name_each_group_when_two_share_a_host():
    torch.manual_seed(0)
    model = TwoConvolutions()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 3, 8, 8)
    ctl = barter.wrap(model, optimizer, total_steps=6, density=0.5, example_inputs=(x,), method="random_pair",
                      window=(0.0, 1.0))
    for _ in range(6):
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    names = [g.name for g in ctl.surgeon.groups]
    assert len(names) == 2 and {g.module for g in ctl.surgeon.groups} == {""}
    # two oracles: the groups' counts, and the convolutions' output channels
    assert ctl.topology() == {g.name: {"channel": g.count} for g in ctl.surgeon.groups}
    assert sorted(n["channel"] for n in ctl.topology().values()) == sorted(
        [model.c1.weight.shape[0], model.c2.weight.shape[0]])
    done = [e for e in ctl.events if e["skipped"] is None]
    assert done and all({e["donor_group"], e["receiver_group"]} == set(names) for e in done)
