"""Calls into a host's modules from outside its forward (timm's `forward_features` / `forward_head` where the host is
the whole model): its graphs serve the forward only, so such a call runs the modules' own code on the compact
tensors. Where that code follows the widths as it is (ResNeSt), the call runs and agrees with the forward; where it
does not (Visformer's attention reshapes by its stored head count), the call is refused, naming the module and what
goes wrong, instead of failing on a shape or computing a wrong result. The host's own forward, which calls the same
modules for the calls its graphs do not serve, is not refused."""
from __future__ import annotations

import copy

import pytest
import torch

from fxsurgery import Surgeon, UnservedCall
from fxsurgery.compat import module_hooks
from fxsurgery.runtime.graph_forward import GraphForward
from fxsurgery.runtime.outside_calls import OutsideCallGuard

timm = pytest.importorskip("timm")


def shrunk(name: str, **kwargs) -> tuple[torch.nn.Module, Surgeon, torch.Tensor]:
    """``name`` analysed as a whole (its host is the model) with the first unit of every group removed."""
    torch.manual_seed(0)
    model = timm.create_model(name, num_classes=5, **kwargs).eval()
    x = torch.randn(2, 3, 64, 64)
    surgeon = Surgeon(model, (x,))
    assert GraphForward.of(model) is not None, surgeon.explain()  # the model is the host
    for group in surgeon.groups:
        if group.exact and group.count > max(group.min_count, 1):
            surgeon.keep(group, range(1, group.count))
    return model, surgeon, x


def test_modules_whose_code_follows_the_widths_serve_calls_from_outside_the_forward() -> None:
    model, _, x = shrunk("resnest14d")
    twin = copy.deepcopy(model)  # an EMA copy: its guards judge the copy
    with torch.no_grad():
        torch.testing.assert_close(model.forward_head(model.forward_features(x)), model(x))
        torch.testing.assert_close(twin.forward_head(twin.forward_features(x)), model(x))


def test_modules_whose_code_does_not_follow_the_widths_refuse_calls_from_outside_the_forward() -> None:
    model, _, x = shrunk("visformer_tiny", depth=2, img_size=64)
    with torch.no_grad():
        assert torch.isfinite(model(x)).all()  # the forward its graphs serve
        with pytest.raises(UnservedCall, match=r"is called outside the forward of the model \(Visformer\).*"
                                               r"fails once a unit is removed"):
            model.forward_features(x)
        with pytest.raises(UnservedCall, match="is called outside the forward of the model"):
            model.stage2[0](torch.randn(2, 384, 8, 8))
        twin = copy.deepcopy(model)
        guards = [h for m in twin.modules() for h in module_hooks(m) if isinstance(h, OutsideCallGuard)]
        assert guards and all(guard.host is twin for guard in guards)  # the copy's guards judge the copy
        torch.testing.assert_close(twin(x), model(x))
        with pytest.raises(UnservedCall, match="is called outside the forward of the model"):
            twin.forward_features(x)
