"""The symbolic tracer records the arguments of every call as torch.fx's own tracer does (it answers the common ones
first): proxies, plain values, tuples and keyword dicts, and parameters, buffers and modules inside them."""
from __future__ import annotations

import pytest
import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F

from fxsurgery.analysis.host import same_graphs
from fxsurgery.capture.tracer import Tracer


class Arguments(nn.Module):
    """Calls whose arguments hold every kind the tracer answers: nested tuples with a parameter and a buffer in them,
    keyword dicts, slices, None, floats, strings, a dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 6))
        self.register_buffer("offset", torch.randn(6))

    def forward(self, x: torch.Tensor, scale: float = 0.5) -> torch.Tensor:
        y = torch.cat((x, (x * scale)), dim=-1)[:, 1:]
        y = F.pad(y, (0, 1), mode="constant", value=None)
        y = torch.stack((y[:, :4] @ self.weight, y[:, :6] + self.offset), dim=0).sum(0)
        y = torch.mul(input=torch.add(y, other=self.offset, alpha=2), other=y)
        z = torch.einsum("bi,bi->b", y, y).to(dtype=torch.float64)
        return torch.where(z > 0, z, torch.zeros_like(z)).reshape(x.shape[0], 1) + y.sum(dim=(1,), keepdim=True)


def test_the_tracer_records_the_arguments_fx_records() -> None:
    module = Arguments()
    ours, theirs = Tracer().trace(module), torch.fx.Tracer().trace(module)
    assert ours.python_code("self").src == theirs.python_code("self").src
    x = torch.randn(3, 4)
    gm = torch.fx.GraphModule(module, ours)
    assert torch.equal(gm(x), module(x))


class ModeDependent(nn.Module):
    """Reads the mode as an argument (functional dropout), in a branch, or not at all."""

    def __init__(self, how: str):
        super().__init__()
        self.how, self.fc = how, nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.how == "argument":
            return F.dropout(self.fc(x), 0.1, self.training)
        if self.how == "branch" and self.training:
            return self.fc(x) * 2
        return self.fc(x)


@pytest.mark.parametrize("how", ["argument", "branch", "none"])
def test_graphs_are_the_same_where_their_code_is(how: str) -> None:
    """A host traced in train mode serves eval mode where both graphs make the same code: read from the nodes."""
    module = ModeDependent(how)
    graphs = []
    for mode in (True, False):
        module.train(mode)
        graphs.append(Tracer().trace(module))
    code = [g.python_code("self").src for g in graphs]
    assert same_graphs(*graphs) == (code[0] == code[1]) == (how == "none")
    assert same_graphs(graphs[0], graphs[0])
