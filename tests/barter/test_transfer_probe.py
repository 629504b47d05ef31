"""What a transfer does, as its event records it (`barter.transfer_probe`): the scores it was chosen on, the probe
loss around it, its units' next relative updates; checked against recomputations on copies of the model, and
training unchanged by the probe."""
import copy
import math

import pytest
import torch

import barter
from barter.transfer_event import DELAYS, PROBE_FIELDS, ROLES
from barter.transfer_probe import UPDATE_STEPS

timm = pytest.importorskip("timm")
T = 150
WINDOW = (0.05, 0.3)  # transfers up to step 45: every one is followed by 100 steps


def build():
    torch.manual_seed(0)
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=5, img_size=16, patch_size=8,
                             depth=2, embed_dim=64, num_heads=4, mlp_ratio=2.0, drop_path_rate=0.1, proj_drop_rate=0.1)


def batch(step):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(8, 3, 16, 16, generator=g), torch.randint(0, 5, (8,), generator=g)


PROBE = batch(-1)


def oracle_loss(model):
    """The probe batch's cross-entropy on a copy of `model` in eval mode."""
    twin = copy.deepcopy(model).eval()
    with torch.no_grad():
        return torch.nn.functional.cross_entropy(twin(PROBE[0]), PROBE[1]).item()


def channel_weights(model, group, index):
    """An FFN channel's parameters by timm's names: its fc1 row and bias, its fc2 column."""
    mlp = model.get_submodule(group.split(":")[0])
    return torch.cat([mlp.fc1.weight[index], mlp.fc1.bias[index].view(1), mlp.fc2.weight[:, index]]).detach().clone()


def run(probe, steps=range(1, T + 1), start=None):
    """Train a wrapped tiny ViT over `steps` (from `start`'s saved states when given). With `probe`, optimizer
    hooks around the controller's record the oracles: the probe loss before each step's transfers and after them,
    and the first channel transfer's parent weights right after it and after the next step."""
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.05)
    seen = {"before": {}, "after": {}, "parent": []}
    step = [steps[0] - 1]

    def before(*_):
        step[0] += 1
        if probe:
            seen["before"][step[0]] = oracle_loss(model)
            if len(seen["parent"]) == 1:
                e = seen["first"]
                seen["parent"].append(channel_weights(model, e["receiver_group"], e["parent_index"]))

    def after(*_):
        if probe and ctl.events and ctl.events[-1]["step"] == step[0]:
            seen["after"][step[0]] = oracle_loss(model)
            channel = [e for e in ctl.events if e["kind"] == "channel" and e["skipped"] is None]
            if channel and not seen["parent"]:
                seen["first"] = channel[0]
                seen["parent"].append(channel_weights(model, channel[0]["receiver_group"], channel[0]["parent_index"]))

    opt.register_step_post_hook(before)  # runs before the controller's hook, which wrap registers next
    ctl = barter.wrap(model, opt, total_steps=T, density=0.5, seed=0, window=WINDOW)
    opt.register_step_post_hook(after)
    if probe:
        ctl.watch_transfers(*PROBE)
    if start is not None:
        ctl.load_state_dict(start["controller"])
        model.load_state_dict(start["model"])
        opt.load_state_dict(start["optimizer"])
        torch.set_rng_state(start["rng"])  # drop path draws from it
    for s in steps:
        x, y = batch(s)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return ctl, opt, seen


@pytest.fixture(scope="module")
def runs():
    torch.manual_seed(123)
    plain = run(probe=False)
    plain_rng = torch.get_rng_state()
    torch.manual_seed(123)
    probed = run(probe=True)
    return plain, plain_rng, probed, torch.get_rng_state()


def executed(ctl):
    return [e for e in ctl.events if e["skipped"] is None]


def test_every_transfer_records_finite_probe_fields_and_nonzero_scores(runs):
    (ctl, _, seen) = runs[2]
    done = executed(ctl)
    assert len(done) >= 5 and {e["kind"] for e in done} == {"head", "channel"}
    for e in done:
        assert set(PROBE_FIELDS) <= set(e)
        for key in ("donor_D", "receiver_R", "parent_S"):
            assert math.isfinite(e[key]) and e[key] > 0, (key, e)
        for key in ("probe_loss_before", "probe_loss_after", *(f"probe_loss_{d}" for d in DELAYS)):
            assert math.isfinite(e[key]), (key, e)
        # a list stops early only when a later transfer removed a unit of that layer meanwhile
        removals = any(x["donor_group"] == e["receiver_group"] and e["step"] < x["step"] <= e["step"] + UPDATE_STEPS
                       for x in done)
        for role in ROLES:
            sizes = e[f"update_{role}"]
            if role == "kept" and sizes is None:
                continue
            assert all(math.isfinite(r) and r > 0 for r in sizes), (role, e)
            assert len(sizes) == UPDATE_STEPS or (removals and 0 < len(sizes) < UPDATE_STEPS), (role, e)
    assert any(e["update_kept"] is not None for e in done)


def test_probe_losses_equal_recomputations_on_copies_of_the_model(runs):
    (ctl, _, seen) = runs[2]
    done = executed(ctl)
    last_at = {e["step"]: e for e in done}  # the last transfer of each step
    for e in done:
        if e is next(x for x in done if x["step"] == e["step"]):  # the first of its step: nothing moved before it
            assert e["probe_loss_before"] == pytest.approx(seen["before"][e["step"]], rel=1e-6, abs=1e-7)
        for d in DELAYS:
            assert e[f"probe_loss_{d}"] == pytest.approx(seen["before"][e["step"] + d], rel=1e-6, abs=1e-7)
    for s, e in last_at.items():
        assert e["probe_loss_after"] == pytest.approx(seen["after"][s], rel=1e-6, abs=1e-7)
    # a clone keeps the function: the loss moves by the removal only, so not by more than a removal can
    assert all(abs(e["probe_loss_after"] - e["probe_loss_before"]) < 1 for e in done)


def test_update_size_equals_a_recomputation_from_the_named_weights(runs):
    (ctl, _, seen) = runs[2]
    after, next_step = seen["parent"][:2]
    expected = ((next_step - after).norm() / after.norm()).item()
    assert seen["first"]["update_parent"][0] == pytest.approx(expected, rel=1e-5)


def test_probe_leaves_training_and_random_streams_unchanged(runs):
    (plain, plain_opt, _), plain_rng, (probed, probed_opt, _), probed_rng = runs
    assert torch.equal(plain_rng, probed_rng)
    assert [{k: v for k, v in e.items() if k not in PROBE_FIELDS} for e in probed.events] == plain.events
    for (n1, p1), (n2, p2) in zip(plain.model.named_parameters(), probed.model.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2), n1
    assert not set(PROBE_FIELDS) & {k for e in plain.events for k in e}


def test_resumed_run_fills_the_fields_due_across_the_cut(runs):
    (ctl, _, _) = runs[2]
    cut = 40  # transfers before it still wait for their 100-step loss and some for their update sizes
    first, opt, _ = run(probe=True, steps=range(1, cut + 1))
    saved = copy.deepcopy({"controller": first.state_dict(), "model": first.model.state_dict(),
                           "optimizer": opt.state_dict(), "rng": torch.get_rng_state()})
    assert saved["controller"]["probe"]["due"] and saved["controller"]["probe"]["watched"]
    resumed, _, _ = run(probe=True, steps=range(cut + 1, T + 1), start=saved)
    assert resumed.events == ctl.events
