"""An analysis does not depend on the model's history: a model fresh from its constructor (what a user wraps right
after ``timm.create_model``), the same model after one call (in train or eval mode) and after one training step
(SGD on a random batch) have the same groups (names, kinds, modules, counts, bounds, exactness, slices) and leave
out the same modules. `make test` draws a few cheap models of the conformance lists; `make soak` runs every model of
every list (ConViT among them, whose attention fills a placeholder buffer on its first call; tests/fxsurgery's API
tests check it never called and called once on every run)."""
from __future__ import annotations

import pytest
import torch
from conformance_checks import model_cases, training_loss
from hypothesis import given, settings
from hypothesis import strategies as st
from test_conformance import conformance_cases
from test_families_table import FAMILIES

from fxsurgery import Analysis, analyse


def every_case() -> dict[str, tuple]:
    """name -> (builder, input) over the conformance lists (a model on several lists at its first list's settings)."""
    found: dict[str, tuple] = {}
    for name, build, x in conformance_cases() + model_cases(FAMILIES, depth=None):
        found.setdefault(name, (build, x))
    return found


CASES = every_case()
# models whose three analyses take 2-4 s in all on 2 shared cores (ConViT's take 36 s)
CHEAP = ["test_vit", "deit_tiny_patch16_224", "test_vit_relpos", "torchvision_vit"]


def description(analysis: Analysis) -> tuple:
    """What an analysis says through its public records: every group, and every module left out with its reasons."""
    groups = tuple((g.name, g.kind, g.module, g.count, g.max_count, g.min_count, g.exact, tuple(g.slices))
                   for g in analysis.groups)
    return groups, tuple((lo.module, tuple(lo.reasons)) for lo in analysis.left_out)


def random_batch(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """A batch like ``x``: normal values, or token ids below its largest."""
    if x.is_floating_point():
        return torch.randn(x.shape, generator=generator)
    return torch.randint(0, int(x.max()) + 1, x.shape, generator=generator)


def assert_history_free(name: str, seed: int, call_mode: str, lr: float) -> None:
    build, x = CASES[name]
    torch.manual_seed(seed)
    model = build()
    fresh = analyse(model, (x,))
    getattr(model, call_mode)()
    with torch.no_grad():
        model(x)
    model.train()
    called = analyse(model, (x,))
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    training_loss(model(random_batch(x, generator)), torch.randint(0, 2, (x.shape[0],), generator=generator)).backward()
    optimizer.step()
    trained = analyse(model, (x,))
    assert description(fresh) == description(called), f"{name}: a call (in {call_mode} mode) changed the analysis"
    assert description(fresh) == description(trained), f"{name}: a training step (SGD, lr {lr}) changed the analysis"
    assert any(g.kind == "head" for g in fresh.groups) or name != "convit_tiny", "ConViT's heads were not found"


HISTORY = {"seed": st.integers(0, 2**16), "call_mode": st.sampled_from(["train", "eval"]),
           "lr": st.floats(1e-4, 0.1)}


@settings(max_examples=3)
@given(name=st.sampled_from(CHEAP), **HISTORY)
def test_fresh_called_and_trained_models_have_the_same_groups(name, seed, call_mode, lr) -> None:
    assert_history_free(name, seed, call_mode, lr)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
@settings(max_examples=1)
@given(**HISTORY)
def test_every_conformance_model_has_the_same_groups_fresh_called_and_trained(name, seed, call_mode, lr) -> None:
    assert_history_free(name, seed, call_mode, lr)
