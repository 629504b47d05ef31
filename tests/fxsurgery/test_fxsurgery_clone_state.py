"""Optimizer state at a clone (`StateAtClone`): zeroed, split with the weights, or restarted with Adam's bias
correction of its own; each checked against its formula on the moments and, for restart, against Adam written out."""
from __future__ import annotations

import pytest
import timm
import torch

from fxsurgery import OptimizerStateError, StateAtClone, Surgeon, correct_restarted
from fxsurgery.clone_state import RESTART_KEY

PARENT = 2
GROUP = "blocks.0.mlp:channel"


def setup(make_optimizer, steps: int = 3):
    """A tiny timm ViT with ``steps`` optimizer steps taken; returns (surgeon, optimizer, batch)."""
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", num_classes=5, img_size=32, patch_size=8, depth=2,
                              embed_dim=32, num_heads=2, mlp_ratio=1.0)
    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 5, (4,))
    surgeon = Surgeon(model, (x,))
    opt = make_optimizer(model.parameters())
    surgeon.attach_optimizer(opt)
    for _ in range(steps):
        train_step(model, opt, x, y)
    return surgeon, opt, (x, y)


def train_step(model, opt, x, y) -> None:
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def moments(surgeon, opt):
    """{(tensor name, key): a copy} of fc1's and fc2's state."""
    out = {}
    for name in ("blocks.0.mlp.fc1.weight", "blocks.0.mlp.fc1.bias", "blocks.0.mlp.fc2.weight"):
        p = surgeon.model.get_parameter(name)
        for key, value in opt.state[p].items():
            out[name, key] = value.clone()
    return out


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.05)


def adam(params):
    return torch.optim.Adam(params, lr=1e-2)


@pytest.mark.parametrize("make", [adamw, adam])
@pytest.mark.parametrize("parent", [0, PARENT, 31])  # the first, a middle and the last of 32 channels
@pytest.mark.parametrize("how", list(StateAtClone))
def test_state_after_a_clone_equals_the_formula_of_each_policy(how, parent, make):
    surgeon, opt, _ = setup(make)
    before = moments(surgeon, opt)
    new = surgeon.clone(surgeon.group(GROUP), parent, state=how)
    after = moments(surgeon, opt)
    for (name, key), old in before.items():
        now = after[name, key]
        if key == "step":
            assert torch.equal(now, old)  # the step counter is kept by every policy
            continue
        rows = name.endswith("fc1.weight") or name.endswith("fc1.bias")
        units = (lambda t: t) if rows else (lambda t: t.T)  # unit i: fc1's row i, fc2's column i
        old_u, now_u = units(old), units(now)
        others = [i for i in range(len(old_u)) if i != parent]
        assert torch.equal(now_u[others], old_u[others]), (name, key)  # kept units keep their state
        assert old_u[parent].abs().sum() > 0
        if how is StateAtClone.SPLIT:
            scale = 1.0 if rows else {"exp_avg": 0.5, "exp_avg_sq": 0.25}[key]  # output columns: m/2, v/4
            expected = old_u[parent] * scale
        else:
            expected = torch.zeros_like(old_u[parent])
        assert torch.equal(now_u[parent], expected) and torch.equal(now_u[new], expected), (how, name, key)
    if how is StateAtClone.RESTART:
        fc2 = surgeon.model.get_parameter("blocks.0.mlp.fc2.weight")
        stamp = opt.state[fc2][RESTART_KEY]
        assert (stamp[:, [parent, new]] == 3).all() and (stamp[:, others] == 0).all()
    else:
        assert all(key != RESTART_KEY for _, key in after)


@pytest.mark.parametrize("make", [adamw, lambda params: torch.optim.Adam(params, lr=1e-2, weight_decay=0.01,
                                                                           amsgrad=True)],
                         ids=["adamw", "adam_l2_amsgrad"])
def test_restarted_units_step_as_adam_from_the_clone_and_kept_units_as_before(make):
    """Oracle: Adam written out, with a step counter that starts at the clone for the parent and its copy and
    the parameter's own for every other unit."""
    surgeon, opt, (x, y) = setup(make)
    new = surgeon.clone(surgeon.group(GROUP), PARENT, state=StateAtClone.RESTART)
    model = surgeon.model
    fc2 = model.get_parameter("blocks.0.mlp.fc2.weight")
    opt.register_step_post_hook(lambda optimizer, *_: correct_restarted(optimizer))
    group = opt.param_groups[0]
    (b1, b2), lr, eps, wd = group["betas"], group["lr"], group["eps"], group["weight_decay"]
    m = opt.state[fc2]["exp_avg"].clone()
    v = opt.state[fc2]["exp_avg_sq"].clone()
    vmax = opt.state[fc2].get("max_exp_avg_sq", v).clone()
    for k in range(1, 5):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        w, g = fc2.detach().clone(), fc2.grad.clone()
        if isinstance(opt, torch.optim.AdamW):
            w_decayed = w * (1 - lr * wd)
        else:
            g, w_decayed = g + wd * w, w
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        vmax = torch.maximum(vmax, v)
        denom = vmax if group["amsgrad"] else v
        t = 3 + k
        steps = torch.full_like(w, float(t))
        steps[:, [PARENT, new]] = k
        expected = w_decayed - lr / (1 - b1 ** steps) * m / (denom.sqrt() / (1 - b2 ** steps).sqrt() + eps)
        opt.step()
        torch.testing.assert_close(fc2.detach(), expected, rtol=1e-5, atol=1e-7)
    assert (fc2.detach()[:, [PARENT, new]] != 0).all()


def test_bad_combinations_are_refused_naming_the_state():
    surgeon, opt, _ = setup(lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9))
    group = surgeon.group(GROUP)
    with pytest.raises(OptimizerStateError, match="restart.*SGD has none"):
        surgeon.clone(group, PARENT, state=StateAtClone.RESTART)
    assert group.count == 32  # refused before any edit
    with pytest.raises(ValueError, match="'nope' is not a valid StateAtClone"):
        surgeon.clone(group, PARENT, state="nope")
    surgeon.clone(group, PARENT, state="split")  # momentum is of degree 1: halved on fc2's columns
    fc2 = surgeon.model.get_parameter("blocks.0.mlp.fc2.weight")
    buf = opt.state[fc2]["momentum_buffer"]
    torch.testing.assert_close(buf[:, PARENT], buf[:, -1])

    class Traced(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {})

        def step(self, closure=None):
            for p in self.param_groups[0]["params"]:
                self.state[p]["trace"] = torch.zeros_like(p)

    surgeon, opt, _ = setup(Traced, steps=1)
    with pytest.raises(OptimizerStateError, match="state 'trace' has no known degree"):
        surgeon.clone(surgeon.group(GROUP), PARENT, state=StateAtClone.SPLIT)
