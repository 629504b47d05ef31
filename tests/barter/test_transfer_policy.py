"""The parts of a transfer as `barter.wrap` options (`barter.transfer_policy`): one side only, counts, window,
optimizer state at a clone, fading removal, and the paper's policy by name; on a tiny timm ViT."""
import copy

import pytest
import torch
from tiny_vit import build_vit, vit_batch

import barter
from barter.options import Options
from barter.schedule import rnd
from barter.training.runlog import width_history
from barter.transfer_policy import POLICIES, VARIANTS, PolicyName, TransferPolicy, variants_help
from fxsurgery.clone_state import RESTART_KEY

T = 40  # window 4..16: five channel transfers, one head transfer
X = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(7))


def new(total=T, optimizer=torch.optim.AdamW, **options):
    model = build_vit()
    opt = optimizer(model.parameters(), lr=3e-3, weight_decay=0.05)
    return barter.wrap(model, opt, total_steps=total, density=0.5, auto=False, **options), opt


def width(ctl, kind):
    return sum(g.count for g in ctl.layers[kind])


def run(ctl, opt, steps, around_step=None):
    """Train `steps`, calling `around_step(step)` → a callable run after `ctl.step()` (or None)."""
    for step in steps:
        x, y = vit_batch(step)
        ctl.model.train()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ctl.model(x), y).backward()
        opt.step()
        after = around_step(step) if around_step else None
        ctl.step()
        if after:
            after()


def outputs(model):
    model.eval()
    with torch.no_grad():
        return model(X)


def test_the_paper_policy_by_name_is_the_default_and_runs_alike():
    assert Options().policy == POLICIES[PolicyName.PAPER]
    named = Options.from_kwargs(transfer_policy="paper", clone_state="carry").policy
    assert named == POLICIES[PolicyName.PAPER].__class__(clone_state="carry")  # a part given wins over the name
    default, opt = new(total=20)
    by_name, opt2 = new(total=20, transfer_policy=PolicyName.PAPER)
    run(default, opt, range(1, 21))
    run(by_name, opt2, range(1, 21))
    assert default.events == by_name.events and any(e["skipped"] is None for e in default.events)
    assert all(torch.equal(a, b) for a, b in zip(default.model.parameters(), by_name.model.parameters()))


def test_each_named_variant_is_a_distinct_policy_and_paper_is_the_papers():
    """The studies' variants as `barter.wrap` options: each valid, each a different policy, paper's the paper's; a
    variant's options are plain values (a config file records them) and name its row."""
    policies = {name: Options.from_kwargs(**variant.wrap_options()).policy for name, variant in VARIANTS.items()}
    assert policies["paper"] == POLICIES[PolicyName.PAPER] == TransferPolicy()
    assert len(set(policies.values())) == len(VARIANTS)
    assert policies["count0.5"].count_scale == 0.5 and policies["fade"].removal == "fade"
    assert all(type(value) in (str, float, int) for v in VARIANTS.values() for value in v.wrap_options().values())
    assert VARIANTS["fade"].label == "barter (fade)"
    assert variants_help().count(" (") == len(VARIANTS) and "count0.5 (transfer counts x 0.5)" in variants_help()


@pytest.mark.parametrize("scale", [0.5, 1, 2, 4])
def test_count_scale_multiplies_the_papers_counts(scale):
    ctl, _ = new(count_scale=scale)
    channels, heads = width(ctl, "channel"), width(ctl, "head")  # 3 layers of 32 channels, of 2 heads
    assert len(ctl.schedule["channel"]) == max(1, rnd(channels * 60 / 1067 * scale))
    assert len(ctl.schedule["head"]) == max(1, rnd(heads * 2 / 34 * scale))
    assert len(ctl.schedule["channel"]) == {0.5: 3, 1: 5, 2: 11, 4: 22}[scale]


def test_window_places_every_proposal_inside_it():
    ctl, _ = new(total=100, window=(0.5, 0.9))
    steps = ctl.schedule["channel"] + ctl.schedule["head"]
    assert min(steps) > 50 and max(steps) <= 90 and len(ctl.schedule["channel"]) == 5


def output_slice(model, kind, module, index):
    """The output weights of unit `index` of `module` (timm ViT names; head_dim 16)."""
    if kind == "channel":
        return model.get_parameter(f"{module}.fc2.weight")[:, index]
    return model.get_parameter(f"{module}.proj.weight")[:, 16 * index:16 * (index + 1)]


def test_removals_only_masks_donors_and_never_clones():
    ctl, opt = new(transfer_parts="removals")
    budget = {kind: width(ctl, kind) for kind in ("head", "channel")}
    diffs = []

    def check(step):
        snapshot, n = copy.deepcopy(ctl.model), len(ctl.events)
        for m in snapshot.modules():
            m._forward_pre_hooks.clear()

        def after():
            done = [e for e in ctl.events[n:] if e["skipped"] is None]
            for e in done:
                assert e["new_index"] is None and e["receiver_group"] is None and e["donor_group"] is not None
            if done:  # removal = masking: the model before, its donors' output slices zeroed, gives the same outputs
                with torch.no_grad():
                    for e in done:
                        output_slice(snapshot, e["kind"], e["donor_layer"], e["donor_index"]).zero_()
                y0 = outputs(snapshot)
                diffs.append(float((outputs(ctl.model) - y0).abs().max() / y0.abs().max()))
        return after

    run(ctl, opt, range(1, T + 1), check)
    executed = [e for e in ctl.events if e["skipped"] is None]
    assert len(executed) == 6 and diffs and max(diffs) <= 1e-5
    for kind in ("head", "channel"):  # the width ends K under the budget, never over it
        assert width(ctl, kind) == budget[kind] - sum(e["kind"] == kind for e in executed)


def test_clones_only_starts_under_the_budget_ends_at_it_and_keeps_the_function():
    reference, _ = new()
    budget = {kind: width(reference, kind) for kind in ("head", "channel")}
    ctl, opt = new(transfer_parts="clones")
    initial = ctl.topology()
    planned = {kind: len(ctl.schedule[kind]) for kind in ("head", "channel")}
    assert planned == {kind: len(reference.schedule[kind]) for kind in ("head", "channel")}
    assert {kind: width(ctl, kind) + planned[kind] for kind in planned} == budget
    diffs, most = [], {kind: 0 for kind in planned}

    def check(step):
        y0, n = outputs(ctl.model), len(ctl.events)

        def after():
            if any(e["skipped"] is None for e in ctl.events[n:]):
                y1 = outputs(ctl.model)
                diffs.append(float((y1 - y0).abs().max() / y0.abs().max()))
            for kind in planned:
                most[kind] = max(most[kind], width(ctl, kind))
        return after

    run(ctl, opt, range(1, T + 1), check)
    executed = [e for e in ctl.events if e["skipped"] is None]
    assert len(executed) == sum(planned.values()) and all(e["donor_group"] is None for e in executed)
    assert diffs and max(diffs) <= 1e-5  # a clone keeps the function
    assert most == budget and {kind: width(ctl, kind) for kind in planned} == budget
    for g in ctl.layers["channel"]:
        assert g.count >= ctl.policy.minimum("channel") == 1
    assert replays(ctl, initial)


def fc2(ctl, layer):
    return ctl.model.get_parameter(f"blocks.{layer}.mlp.fc2.weight")


@pytest.mark.parametrize("state", ["paper", "carry", "restart"])
def test_optimizer_state_at_a_clone_follows_the_policy(state):
    ctl, opt = new(clone_state=state)
    first = ctl.schedule["channel"][0]
    saved = {}

    def keep_state(step):
        if step == first:
            saved.update({i: {k: v.clone() for k, v in opt.state[fc2(ctl, i)].items()} for i in range(3)})
        return None

    run(ctl, opt, range(1, first + 1), keep_state)
    e = next(e for e in ctl.events if e["kind"] == "channel" and e["skipped"] is None)
    layer = int(e["receiver_group"].split(".")[1])
    st, old = opt.state[fc2(ctl, layer)], saved[layer]
    parent, new_unit = e["parent_index"], e["new_index"]
    for key, factor in (("exp_avg", 0.5), ("exp_avg_sq", 0.25)):
        expected = old[key][:, parent] * factor if state == "carry" else torch.zeros_like(old[key][:, parent])
        assert torch.equal(st[key][:, parent], expected) and torch.equal(st[key][:, new_unit], expected)
        assert old[key][:, parent].abs().sum() > 0
    assert torch.equal(st["step"], old["step"])
    if state == "restart":
        assert (st[RESTART_KEY][:, [parent, new_unit]] == first).all()
        assert st[RESTART_KEY].count_nonzero() == 2 * st[RESTART_KEY].shape[0]
    else:
        assert RESTART_KEY not in st


def test_restart_needs_adam():
    with pytest.raises(ValueError, match="restart.*SGD has none"):
        new(optimizer=lambda params, lr, weight_decay: torch.optim.SGD(params, lr=lr), clone_state="restart")


def replays(ctl, initial) -> bool:
    """Whether widths.png's history, replayed back from the final widths through the events, starts at `initial`."""
    history = width_history(ctl.topology(), ctl.events)
    return {group: {kind: series[0][1]} for kind, groups in history.items()
            for group, series in groups.items()} == initial


def test_fade_zeroes_the_donor_before_removing_it_and_the_removal_changes_nothing():
    ctl, opt = new(removal="fade")
    initial = ctl.topology()
    seen = []
    remove = ctl.surgeon.remove

    def spy(group, index):
        weights = output_slice(ctl.model, group.kind, group.module, index).detach()
        y0 = outputs(ctl.model)
        remove(group, index)
        seen.append((float(weights.abs().max()), float((outputs(ctl.model) - y0).abs().max())))

    ctl.surgeon.remove = spy
    fractions = []

    def watch(step):
        fading = [(f, output_slice(ctl.model, f.kind, ctl.layers[f.kind][f.layer].module, f.index).detach().clone())
                  for f in ctl.fading]

        def after():
            for fade, w in fading:
                j = ctl.step_count - fade.start
                if 0 < j < fade.length and fade in ctl.fading:  # scaled from 1 - (j-1)/L to 1 - j/L of its value
                    now = output_slice(ctl.model, fade.kind, ctl.layers[fade.kind][fade.layer].module, fade.index)
                    fractions.append(float((now.detach() / w).mean()) - (fade.length - j) / (fade.length - j + 1))
        return after

    run(ctl, opt, range(1, T + 1), watch)
    executed = [e for e in ctl.events if e["skipped"] is None]
    assert len(seen) == len(executed) == 6 and not ctl.fading
    assert all(weight == 0 and change <= 1e-6 for weight, change in seen), seen
    assert fractions and max(abs(f) for f in fractions) < 1e-5
    for e in executed:
        assert e["removed_at"] == e["step"] + ctl._schedule.cooldown[e["kind"]]
    assert replays(ctl, initial)


def test_fades_are_cut_short_to_end_by_the_last_step():
    ctl, opt = new(removal="fade", window=(0.5, 1.0))
    budget = {kind: width(ctl, kind) for kind in ("head", "channel")}
    run(ctl, opt, range(1, T + 1))
    executed = [e for e in ctl.events if e["skipped"] is None]
    assert executed[-1]["step"] == T and executed[-1]["removed_at"] == T  # proposed at the last step: removed at once
    assert all(e["removed_at"] <= T for e in executed) and not ctl.fading
    assert {kind: width(ctl, kind) for kind in budget} == budget


@pytest.mark.parametrize("options", [dict(removal="fade"), dict(clone_state="restart"), dict(clone_state="carry")],
                         ids=["fade", "restart", "carry"])
def test_a_run_resumed_mid_window_equals_the_uninterrupted_one(options):
    """Fades in progress (the controller's state) and restarted bias corrections (the optimizer's) resume."""
    ref, opt = new(**options)
    run(ref, opt, range(1, T + 1))
    part, opt = new(**options)
    run(part, opt, range(1, 11))
    assert part.fading if "removal" in options else any(e["skipped"] is None for e in part.events)
    saved = copy.deepcopy((part.model.state_dict(), opt.state_dict(), part.state_dict()))
    fresh, opt2 = new(**options)
    fresh.load_state_dict(saved[2])
    fresh.model.load_state_dict(saved[0])
    opt2.load_state_dict(saved[1])
    run(fresh, opt2, range(11, T + 1))
    assert fresh.events == ref.events
    assert all(torch.equal(a, b) for a, b in zip(ref.model.parameters(), fresh.model.parameters()))


def test_min_heads_keeps_each_layers_last_heads():
    """Each layer of the tiny ViT keeps 2 of its 4 heads at density 0.5: under the paper's policy (0) a head transfer
    may take a layer down to 1 head, and min_heads=2 leaves no layer a head to give (its head transfer finds no
    donor, the layers keep 2 heads at every step) while the channel transfers run as before."""
    lowest, heads = {}, {}
    for min_heads in (0, 2):
        ctl, opt = new(min_heads=min_heads)
        least = []

        def record(step, ctl=ctl, least=least):
            return lambda: least.append(min(g.count for g in ctl.layers["head"]))

        run(ctl, opt, range(1, T + 1), record)
        executed = [e for e in ctl.events if e["skipped"] is None]
        lowest[min_heads] = min(least)
        heads[min_heads] = sum(e["kind"] == "head" for e in executed)
        assert sum(e["kind"] == "channel" for e in executed) == 5
    assert lowest == {0: 1, 2: 2} and heads == {0: 1, 2: 0}


@pytest.mark.parametrize("options,message", [
    (dict(min_heads=-1), "min_heads .* an integer >= 0, got -1"),
    (dict(min_heads=1.5), "min_heads .* an integer >= 0, got 1.5"),
    (dict(transfer_parts="neither"), r"transfer_parts must be one of \['both', 'removals', 'clones'\]"),
    (dict(count_scale=0), "count_scale .* must be a number > 0, got 0"),
    (dict(count_scale=float("inf")), "count_scale .* must be a number > 0"),
    (dict(count_scale="2"), "count_scale .* must be a number > 0, got '2'"),
    (dict(clone_state="fresh"), r"clone_state must be one of \['paper', 'carry', 'restart'\], got 'fresh'"),
    (dict(removal="slow"), r"removal must be one of \['paper', 'fade'\]"),
    (dict(transfer_policy="mine"), r"transfer_policy must be one of \['paper'\]"),
    (dict(window=(0.6, 0.2)), "window must satisfy"),
])
def test_bad_values_are_refused_naming_the_option(options, message):
    with pytest.raises(ValueError, match=message):
        barter.wrap(build_vit(), total_steps=T, **options)
