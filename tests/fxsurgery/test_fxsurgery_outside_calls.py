"""Calls into a host's modules from outside its forward (timm's `forward_features` / `forward_head` where the host is
the whole model): its graphs serve the forward only, so such a call runs the modules' own code on the compact
tensors. Where that code follows the widths (ResNeSt as it is; Visformer and MobileViT with the head counts they
store set for the call, as the own forward sets them), the call runs and agrees with the forward; where it does not
(NextViT's attention takes its head size from its input's channels), the call is refused, naming the module and what
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


@pytest.mark.parametrize("name, kwargs", [("resnest14d", {}), ("visformer_tiny", {"depth": 2, "img_size": 64}),
                                          ("mobilevit_xxs", {})])
def test_modules_whose_code_follows_the_widths_serve_calls_from_outside_the_forward(name, kwargs) -> None:
    model, _, x = shrunk(name, **kwargs)
    with torch.no_grad():
        model.forward_features(x)  # fitted on the first weights, whose attention is nearly uniform: it must hold
        for parameter_name, parameter in model.named_parameters():  # once training sharpens the attention
            if parameter_name.endswith("qkv.weight"):
                parameter.mul_(4)
    twin = copy.deepcopy(model)  # an EMA copy: its guards judge the copy
    with torch.no_grad():
        torch.testing.assert_close(model.forward_head(model.forward_features(x)), model(x))
        torch.testing.assert_close(twin.forward_head(twin.forward_features(x)), model(x))


def test_a_block_called_alone_computes_what_it_computes_within_forward_features() -> None:
    model, _, x = shrunk("visformer_tiny", depth=2, img_size=64)
    block, seen = model.stage2[0], {}
    block.register_forward_hook(lambda module, args, output: seen.update(args=args, output=output))
    with torch.no_grad():
        model.forward_features(x)
        torch.testing.assert_close(block(*seen["args"]), seen["output"])
        assert all(guard.calls == [] for m in model.modules() for guard in module_hooks(m)
                   if isinstance(guard, OutsideCallGuard))  # every call left what it entered


def test_modules_whose_code_does_not_follow_the_widths_refuse_calls_from_outside_the_forward() -> None:
    model, _, x = shrunk("nextvit_small", depths=(1, 1, 5, 1))
    with torch.no_grad():
        assert torch.isfinite(model(x)).all()  # the forward its graphs serve
        with pytest.raises(UnservedCall, match=r"is called outside the forward of the model \(NextViT\).*"
                                               r"fails once a unit is removed"):
            model.forward_features(x)
        assert all(guard.calls == [] for m in model.modules() for guard in module_hooks(m)
                   if isinstance(guard, OutsideCallGuard))  # a refused call left nothing entered either
        twin = copy.deepcopy(model)
        guards = [h for m in twin.modules() for h in module_hooks(m) if isinstance(h, OutsideCallGuard)]
        assert guards and all(guard.host is twin for guard in guards)  # the copy's guards judge the copy
        torch.testing.assert_close(twin(x), model(x))
        with pytest.raises(UnservedCall, match="is called outside the forward of the model"):
            twin.forward_features(x)
