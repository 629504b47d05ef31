"""The concrete-shape capture of a hosted module whose graph holds what export lifts out of the code: a tensor
made in ``forward`` (a graph constant) and a ``torch.no_grad()`` region (a higher-order op with a graph module
of its own). The host is analysed, operated on exactly, and keeps what the region does to gradients; units
that the constant spans are told, since surgery cannot slice a tensor of the code. An op whose ATen form returns more
results than its torch function by default (``unique_consecutive``) is read by position as ATen returns them."""
from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

from fxsurgery import Surgeon


class RegionMlp(nn.Module):
    """An FFN that branches on a shape (symbolic tracing cannot read it), adds a tensor made in the code and
    scales by a factor computed from ``gain`` under ``torch.no_grad()``, so no gradient reaches ``gain``."""

    def __init__(self, dim: int = 4, hidden: int = 5):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)
        self.gain = nn.Parameter(torch.rand(dim) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] > 1:
            x = x + torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=x.dtype)
        with torch.no_grad():
            scale = self.gain.square() @ torch.full((4,), 0.25).to(self.gain)  # matmul: the dtypes must agree
        return self.fc2(F.gelu(self.fc1(x))) * scale


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), RegionMlp(), nn.LayerNorm(4), nn.Linear(4, 2)).double()


def test_constants_and_no_grad_region_in_a_captured_host() -> None:
    model, x = _model(), torch.randn(2, 6, 3, dtype=torch.double)
    masked, keys = copy.deepcopy(model), list(model.state_dict())
    s = Surgeon(model, (x,))
    (ffn,) = [g for g in s.groups if g.module == "1"]
    assert (ffn.kind, ffn.count, ffn.exact) == ("channel", 5, True)
    assert "torch.export" in s.explain()  # the capture, not the symbolic trace, served
    # the constant spans the first layer's outputs, so those channels are told, not sliced
    (told,) = [lo for lo in s.left_out if any("a tensor the code made" in r for r in lo.reasons)]
    assert told.module == ""  # between the first layer (module 0) and the FFN (module 1)
    assert list(model.state_dict()) == keys  # the lifted constant is no state
    cloned = copy.deepcopy(model)
    with torch.no_grad():
        y0 = model(x)
        s.remove(ffn, 0)
        masked[1].fc2.weight[:, 0] = 0
        assert (model(x) - masked(x)).abs().max() <= 1e-9
    sc = Surgeon(cloned, (x,))
    sc.clone(sc.group(ffn.name), 1, noise_std=0.1)
    with torch.no_grad():
        assert (cloned(x) - y0).abs().max() <= 1e-9
    model(x).sum().backward()
    assert model[1].gain.grad is None and model[1].fc1.weight.grad is not None  # the region still blocks it
    assert torch.is_grad_enabled()


class ListFusion(nn.Module):
    """An FFN over the concatenation of a list of feature maps: symbolic tracing would freeze the list's
    tensors as constants (the graph would ignore its inputs), so the capture serves."""

    def __init__(self, dim: int = 4, hidden: int = 5):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(2 * dim, hidden), nn.Linear(hidden, dim)

    def forward(self, features: list[torch.Tensor]) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(torch.cat(features, dim=-1))))


class TwoScales(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.fuse, self.head = nn.Linear(3, 4), nn.Linear(3, 4), ListFusion(), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # neither front end reads the model (data-dependent): its modules are read on their own
            x = x * 2
        return self.head(self.fuse([self.a(x), self.b(x)]))


def test_a_list_of_tensors_is_an_input_not_a_constant() -> None:
    torch.manual_seed(0)
    model, x = TwoScales().double(), torch.randn(2, 6, 3, dtype=torch.double)
    masked = copy.deepcopy(model)
    s = Surgeon(model, (x,))
    (ffn,) = [g for g in s.groups if g.module == "fuse"]
    assert (ffn.count, ffn.exact) == (5, True)
    assert "holds tensors in a list" in s.explain()
    other = torch.randn(3, 7, 3, dtype=torch.double)  # the installed graph reads its inputs, not frozen ones
    with torch.no_grad():
        assert (model(other) - masked(other)).abs().max() <= 1e-9
        s.remove(ffn, 2)
        masked.fuse.fc2.weight[:, 2] = 0
        assert (model(other) - masked(other)).abs().max() <= 1e-9


class EndTokenClassifier(nn.Module):
    """A classifier that reads the end token of each sequence after checking, as a compilable check, that every
    sequence ends alike: the count of end tokens per sequence has one distinct value (``unique_consecutive``, which
    ATen records with three results whatever the flags). Symbolic tracing cannot read the check; the capture serves."""

    def __init__(self, vocab: int = 7, dim: int = 4, hidden: int = 5, end: int = 1):
        super().__init__()
        self.end = end
        self.embed, self.fc1, self.fc2 = nn.Embedding(vocab, dim), nn.Linear(dim, hidden), nn.Linear(hidden, dim)
        self.head = nn.Linear(dim, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        ends = ids.eq(self.end).sum(1)
        torch._check(torch.unique_consecutive(ends).numel() == 1)
        h = self.embed(ids)
        h = h + self.fc2(F.gelu(self.fc1(h)))
        return self.head(h[:, -1])


def test_a_check_of_unique_consecutive_values_in_a_captured_model() -> None:
    torch.manual_seed(0)
    model = EndTokenClassifier().double()
    ids = torch.randint(2, 7, (3, 6))
    ids[:, -1] = model.end
    masked = copy.deepcopy(model)
    s = Surgeon(model, (ids,))
    assert "torch.export" in s.explain()
    (ffn,) = [g for g in s.groups if g.kind == "channel"]
    assert (ffn.count, ffn.exact) == (5, True)
    with torch.no_grad():
        s.remove(ffn, 3)
        masked.fc2.weight[:, 3] = 0
        assert (model(ids) - masked(ids)).abs().max() <= 1e-9
