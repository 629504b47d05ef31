"""One protocol for every training method (`barter.method.TrainingMethod`): BARTER's controller, each baseline and
dense training satisfy it, train through the pipeline's loop, count only the optimizer steps that ran, and keep
the optimizer hooks they install until `close()` removes them."""
import pytest
import torch
from tiny_vit import build_vit, vit_batch

import barter
from barter.baselines import METHODS as BASELINES
from barter.baselines import build_baseline
from barter.method import Dense, TrainingMethod
from barter.training import TrainConfig
from barter.training.loop import train_epoch
from barter.training.recipe import build_criterion
from barter.training.session import build_data, build_session

EXAMPLE = (torch.zeros(2, 3, 32, 32),)
STEPPING = ("barter", *BASELINES)  # the methods that count steps


def build_method(name, model, optimizer):
    """`name`'s method over the tiny ViT: `barter.wrap`'s controller or `build_baseline`'s driver, updating
    early and often so that a few steps reach an update or a transfer."""
    if name == "barter":
        return barter.wrap(model, optimizer, total_steps=8, density=0.5, example_inputs=EXAMPLE, window=(0.1, 0.9))
    return build_baseline(name, model, optimizer, density=0.5, total_steps=8, example_inputs=EXAMPLE,
                          update_interval=1)


def train_step(model, optimizer, step):
    images, labels = vit_batch(step)
    optimizer.zero_grad(set_to_none=True)
    torch.nn.functional.cross_entropy(model(images), labels).backward()
    optimizer.step()


def counted(method):
    return method.state_dict()["step"]


@pytest.mark.parametrize("name", STEPPING)
def test_every_method_satisfies_the_protocol_and_counts_its_optimizer_steps(name):
    model = build_vit()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    method = build_method(name, model, optimizer)
    assert isinstance(method, TrainingMethod)
    for step in range(3):
        train_step(model, optimizer, step)
        method.step()
    assert counted(method) == 3


def test_dense_training_is_a_method_with_nothing_to_step_save_or_export():
    dense = Dense()
    assert isinstance(dense, TrainingMethod) and not isinstance(object(), TrainingMethod)
    assert dense.state_dict() == {} and dense.metrics() == {} and dense.events == []
    assert dense.topology() is None and dense.export({}, {}) is None
    with pytest.raises(ValueError, match="dense"):
        dense.load_state_dict({"step": 3})


@pytest.mark.parametrize("name", ["dense", "barter", *BASELINES])
def test_every_method_trains_through_the_loop(tmp_path, name):
    """Two steps of the pipeline's `train_epoch`: the loop steps the method once per optimizer step, the method
    logs its metrics (the keys the metrics records have always had) and exports when it shrinks the model."""
    options = {"baseline_options": {"update_interval": 1}} if name in BASELINES else {}
    config = TrainConfig(model="cct_2_3x1_32_tiny", img_size=16, dataset="fake", fake_size=32, batch_size=16,
                         epochs=1, device="cpu", out_dir=str(tmp_path), progress=False, density=0.5, method=name,
                         barter_options={"window": (0.1, 0.9)}, **options)
    data = build_data(config)
    session = build_session(config, data, torch.device("cpu"), 4, pretrained=False)
    assert isinstance(session.method, TrainingMethod)
    done, loss, _ = train_epoch(session, config, data, build_criterion(0.0, False), torch.device("cpu"), 2)
    assert done == 2 and session.step == 2 and loss > 0
    state = session.method.state_dict()
    assert state.get("step") == (None if name == "dense" else 2)
    metrics = session.method.metrics()
    assert set(metrics) == {"dense": set(), "barter": {"nonfinite_score_batches"}}.get(name, {"sparse"})
    assert (session.method.topology() is not None) == (name == "barter")
    exported = session.method.export(session.model.state_dict(), state, (torch.zeros(2, 3, 16, 16),))
    assert (exported is not None) == (name == "s2vite")
    if exported is not None:  # the dead units are gone
        assert sum(p.numel() for p in exported.parameters()) < sum(p.numel() for p in session.model.parameters())
    session.method.close()


@pytest.mark.parametrize("name", STEPPING)
def test_optimizer_hooks_are_kept_until_close_and_follow_the_attached_optimizer(name):
    """The method follows the optimizer it was built with; `attach_optimizer` moves its hook to another one;
    after `close()` no optimizer step reaches it (a controller's score taps are gone too). A hook left behind
    would show: a baseline's refuses a second optimizer step without `method.step()`, a controller's counts it."""
    model = build_vit()
    first = torch.optim.Adam(model.parameters(), lr=1e-3)
    method = build_method(name, model, first)
    second = torch.optim.Adam(model.parameters(), lr=1e-3)
    method.attach_optimizer(second)
    train_step(model, first, 0)
    train_step(model, first, 1)
    assert counted(method) == 0
    train_step(model, second, 2)
    method.step()
    assert counted(method) == 1
    method.close()
    train_step(model, second, 3)
    train_step(model, second, 4)
    assert counted(method) == 1
    if name == "barter":
        before = method.scores("head")
        train_step(model, second, 5)
        assert all(torch.equal(d, method.scores("head")[g][0]) for g, (d, _) in before.items())


def test_a_baseline_refuses_an_optimizer_step_it_was_not_stepped_after():
    model = build_vit()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    build_method("rigl", model, optimizer)
    train_step(model, optimizer, 0)
    with pytest.raises(RuntimeError, match="after every optimizer.step"):
        train_step(model, optimizer, 1)
