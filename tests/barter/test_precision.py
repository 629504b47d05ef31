"""Scores under mixed precision: non-finite backwards are skipped and counted, the loss scale cancels, a step
GradScaler skipped is not a step of the schedule, and bf16 autocast trains through transfers."""
import pytest
import torch
from tiny_vit import build_vit, vit_batch

import barter

timm = pytest.importorskip("timm")
T = 40


def new(auto=True, scaler=None):
    model = build_vit()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    return barter.wrap(model, opt, total_steps=T, density=0.5, auto=auto, scaler=scaler), opt


def scaler_step(ctl, opt, scaler, step, overflow=False, autocast=None):
    """One GradScaler step; `overflow` makes every gradient inf, as an fp16 overflow does."""
    x, y = vit_batch(step)
    with autocast or torch.autocast("cpu", enabled=False):
        loss = torch.nn.functional.cross_entropy(ctl.model(x), y)
    opt.zero_grad()
    scaler.scale(loss * (float("inf") if overflow else 1.0)).backward()
    scaler.step(opt)
    scaler.update()


def executed(ctl):
    return [e for e in ctl.events if e["skipped"] is None]


def test_an_overflow_is_skipped_counted_and_not_a_schedule_step():
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    ctl, opt = new(scaler=scaler)
    for step in range(T + 3):
        scaler_step(ctl, opt, scaler, step, overflow=step in (2, 8))  # both inside the window
    ctl.scores("head")  # folds the last backward
    assert ctl.nonfinite_batches == {"head": 2, "channel": 2}
    assert ctl.state_dict()["tables"]["head"]["nonfinite"] == 2
    assert ctl.step_count == T + 1  # the two skipped steps are not schedule steps
    for kind in ("head", "channel"):
        assert all(torch.isfinite(x).all() for pair in ctl.scores(kind).values() for x in pair)
    assert len(executed(ctl)) == len(ctl.events) > 0


def test_scores_do_not_depend_on_the_loss_scale():
    """Same seed and data, with a growing/shrinking GradScaler and without one: the same transfers."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12, growth_interval=3)
    scaled, scaled_opt = new(scaler=scaler)
    plain, plain_opt = new()
    for step in range(T):
        scaler_step(scaled, scaled_opt, scaler, step)
        x, y = vit_batch(step)
        plain_opt.zero_grad()
        torch.nn.functional.cross_entropy(plain.model(x), y).backward()
        plain_opt.step()
    assert scaler.get_scale() != 2.0 ** 12  # the scale moved during the run
    assert scaled.events == plain.events and executed(plain)
    for name, (d, s) in plain.scores("channel").items():
        torch.testing.assert_close(scaled.scores("channel")[name], (d, s))


def test_manual_step_after_a_skipped_optimizer_step_is_ignored():
    scaler = torch.amp.GradScaler("cpu")
    ctl, opt = new(auto=False, scaler=scaler)
    scaler_step(ctl, opt, scaler, 0, overflow=True)
    ctl.step()
    assert ctl.step_count == 0
    scaler_step(ctl, opt, scaler, 1)
    ctl.step()
    assert ctl.step_count == 1


def test_bf16_autocast_trains_through_the_transfers():
    ctl, opt = new()
    for step in range(T):
        x, y = vit_batch(step)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(ctl.model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert executed(ctl) and ctl.nonfinite_batches == {"head": 0, "channel": 0}
