"""copy.deepcopy of a wrapped model and of its controller inside the window: independent, working objects."""
import copy

import pytest
import torch
from tiny_vit import build_vit, vit_batch

import barter

timm = pytest.importorskip("timm")
T = 40


def new():
    model = build_vit()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    return barter.wrap(model, opt, total_steps=T, density=0.5), opt


def train(model, opt, steps):
    for step in steps:
        x, y = vit_batch(step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def probe(model):
    with torch.no_grad():
        return model.eval()(vit_batch(-1)[0]), model.train()


@pytest.fixture(scope="module")
def reference():
    ctl, opt = new()
    train(ctl.model, opt, range(T))
    return ctl


def test_controller_copy_inside_the_window_trains_independently(reference):
    ctl, opt = new()
    train(ctl.model, opt, range(8))
    assert 0 < len(ctl.events) < len(reference.events)
    twin = copy.deepcopy(ctl)
    assert twin.model is not ctl.model and twin.optimizer is not opt
    assert twin.optimizer.param_groups[0]["params"][0] is next(twin.model.parameters())
    train(twin.model, twin.optimizer, range(8, T))  # the copy runs ahead alone: the original is untouched
    assert ctl.step_count == 8 and twin.step_count == T
    assert twin.events == reference.events
    train(ctl.model, opt, range(8, T))
    assert ctl.events == reference.events
    torch.testing.assert_close(probe(ctl.model)[0], probe(twin.model)[0])
    torch.testing.assert_close(probe(ctl.model)[0], probe(reference.model)[0])


def test_model_copy_inside_the_window_is_a_plain_working_model(reference):
    ctl, opt = new()
    train(ctl.model, opt, range(8))
    clone = copy.deepcopy(ctl.model)
    clone_opt = torch.optim.AdamW(clone.parameters(), lr=3e-3)
    train(clone, clone_opt, range(8, 20))  # no taps: it feeds no score table, and its widths stay
    train(ctl.model, opt, range(8, T))
    assert ctl.events == reference.events
    torch.testing.assert_close(probe(ctl.model)[0], probe(reference.model)[0])
    assert probe(clone)[0].shape == (4, 5)
    assert "__deepcopy__" not in ctl.model.__dict__  # the window is over: a copy is an ordinary deepcopy
