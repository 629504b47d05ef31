"""A user's rule for an op of their own (``fxsurgery.register_rule``): the groups it hides are found, and removing its
registration (or replacing a built-in rule) restores the table."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fxsurgery import Surgeon, register_rule


@torch.library.custom_op("fxsurgery_tests::doubled_gelu", mutates_args=())
def doubled_gelu(x: torch.Tensor) -> torch.Tensor:
    """An activation fxsurgery has no rule for: graphs call it as ``torch.ops.fxsurgery_tests.doubled_gelu``."""
    return F.gelu(x) * 2


@doubled_gelu.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


DOUBLED_GELU = torch.ops.fxsurgery_tests.doubled_gelu.default  # the target its graph nodes call


def position_by_position(step):
    """The rule of an op whose output position i carries the coordinates of its input's position i."""
    return step.largs[0]


class Mlp(nn.Module):
    def __init__(self, custom: bool):
        super().__init__()
        self.fc1, self.fc2, self.custom = nn.Linear(4, 6), nn.Linear(6, 4), custom

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        return x + self.fc2(doubled_gelu(h) if self.custom else F.gelu(h))


class TwoMlps(nn.Module):
    """One MLP with a built-in activation, one with the custom op."""

    def __init__(self):
        super().__init__()
        self.plain, self.custom = Mlp(custom=False), Mlp(custom=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.custom(self.plain(x))


@pytest.fixture
def model() -> TwoMlps:
    torch.manual_seed(0)
    return TwoMlps().double()


X = torch.randn(2, 3, 4, dtype=torch.double)


def found(model: nn.Module) -> tuple[list[str], dict[str, list[str]]]:
    """The group names and the left-out reasons by module of a fresh analysis of a copy of ``model``."""
    s = Surgeon(copy.deepcopy(model), (X,))
    return [g.name for g in s.groups], {left.module: left.reasons for left in s.left_out}


def test_a_rule_for_a_custom_op_makes_its_group_found(model):
    groups, left_out = found(model)
    assert groups == ["plain:channel"]
    assert any("no rule for doubled_gelu" in reason for reason in left_out["custom.fc1"])
    with register_rule(DOUBLED_GELU, rule=position_by_position):
        s = Surgeon(copy.deepcopy(model), (X,))
        assert [g.name for g in s.groups] == ["plain:channel", "custom:channel"] and not s.left_out
        s.remove(s.group("custom:channel"), 2)
        masked = copy.deepcopy(model)
        with torch.no_grad():
            masked.custom.fc2.weight[:, 2] = 0
            torch.testing.assert_close(s.model(X), masked(X), rtol=0, atol=1e-12)
        assert s.model.custom.fc2.weight.shape == (4, 5)
    assert found(model)[0] == ["plain:channel"]  # the registration is gone with its handle


def test_a_built_in_rule_is_replaced_only_explicitly_and_comes_back(model):
    with pytest.raises(ValueError, match="already registered: call_function gelu"):
        register_rule(F.gelu, rule=position_by_position)
    with register_rule(DOUBLED_GELU, rule=position_by_position), \
            register_rule(F.gelu, rule=lambda step: None, replace=True):  # gelu's output carries no coordinates
        groups, left_out = found(model)
        assert groups == ["custom:channel"] and any("no linear map reads" in r for r in left_out["plain.fc1"])
    with register_rule(DOUBLED_GELU, rule=position_by_position):
        assert found(model)[0] == ["plain:channel", "custom:channel"]
