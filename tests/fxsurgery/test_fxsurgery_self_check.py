"""The self-check every group passes before it is offered: an intact group passes (with one unit too), a group whose
clone would change the outputs or whose tap point is not where its units enter the others fails with the reason,
and the host is left as it was either way."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from tiny_vit import build_vit

from fxsurgery import Surgeon
from fxsurgery.analysis.verify import self_check
from fxsurgery.taps import TapPoint


@pytest.fixture
def operated() -> tuple[Surgeon, torch.Tensor]:
    model = build_vit().double()
    return Surgeon(model, (torch.randn(2, 3, 32, 32, dtype=torch.double),)), torch.randn(2, 3, 32, 32,
                                                                                        dtype=torch.double)


def host_call(s: Surgeon, g, x: torch.Tensor) -> tuple[tuple, dict]:
    """The (args, kwargs) the group's host is called with when the model runs on ``x``."""
    calls = []
    handle = s.model.get_submodule(g.module).register_forward_pre_hook(
        lambda module, args, kwargs: calls.append((args, kwargs)), with_kwargs=True)
    with torch.no_grad():
        s.model(x)
    handle.remove()
    return calls[0]


def checked(s: Surgeon, g, x: torch.Tensor) -> str | None:
    """The text of the self-check's outcome (a `Reason` naming the group's module), with the host's tensors checked
    to be as they were after it."""
    before = {k: v.clone() for k, v in s.model.state_dict().items()}
    found = self_check(s._editor, g, host_call(s, g, x))
    after = s.model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert found is None or found.module == g.module
    return None if found is None else found.text


@pytest.mark.parametrize("group", ["blocks.0.attn:head", "blocks.1.mlp:channel"])
def test_an_intact_group_passes(operated, group: str) -> None:
    s, x = operated
    g = s.group(group)
    assert checked(s, g, x) is None
    while g.count > 1:  # one unit left: the clone and the tap are checked alone
        s.remove(g, 0)
    assert checked(s, g, x) is None


def test_a_clone_that_copies_the_output_columns_fails(operated) -> None:
    s, x = operated
    g = s.group("blocks.0.attn:head")
    g._state.slices = tuple(dataclasses.replace(sl, output=False) for sl in g.slices)  # the columns copied, not split
    assert checked(s, g, x).startswith("a clone changed the outputs by")


@pytest.mark.parametrize("group", ["blocks.0.attn:head", "blocks.1.mlp:channel"])
def test_a_tap_point_the_graph_does_not_call_fails(operated, group: str) -> None:
    s, x = operated
    g = s.group(group)
    s.model.get_submodule(g.module).__dict__["_unused_tap_point"] = TapPoint()
    plumbing = s._editor.plumbing
    plumbing[g] = dataclasses.replace(plumbing[g], tap_point="_unused_tap_point")
    assert checked(s, g, x).startswith("a removal differs from masking by")


def test_an_inexact_group_s_tap_is_checked_against_masking_its_output_slices(operated) -> None:
    s, x = operated
    g = s.group("blocks.1.mlp:channel")
    vars(g)["exact"] = False  # no clone or removal is compared: the tap alone, against its columns zeroed
    assert checked(s, g, x) is None
    s.model.get_submodule(g.module).__dict__["_unused_tap_point"] = TapPoint()
    s._editor.plumbing[g] = dataclasses.replace(s._editor.plumbing[g], tap_point="_unused_tap_point")
    assert checked(s, g, x).startswith("zeroing unit 0 at its tap point differs from masking it by")
