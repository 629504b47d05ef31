"""A host captured by torch.export makes tensors in its code (ALiBi slopes, position ranges, masks): export writes
the device it ran on into those calls, and the installed graph makes them on the device the module is on at run
time instead. A model analysed on one device runs on another; one built on the meta device is analysed as on the
CPU."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from fxsurgery import Surgeon, analyse
from tests.fxsurgery.test_fxsurgery_alibi import tiny_mpt
from tests.fxsurgery.test_fxsurgery_families_more import LENGTH, VOCAB

transformers = pytest.importorskip("transformers")
IDS = torch.randint(3, VOCAB, (2, LENGTH), generator=torch.Generator().manual_seed(0))


class ShapeBranchingAttention(nn.Module):
    """Attention whose code branches on a size (so torch.export captures it) and makes tensors on its input's device:
    a constant (``torch.tensor``, which export lifts) and a range (``torch.arange``, which it records as a call)."""

    def __init__(self):
        super().__init__()
        self.qkv, self.out, self.heads = nn.Linear(16, 48), nn.Linear(16, 16), 4

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        if n > 3:
            x = x * torch.tensor([1.5], device=x.device)
        position = torch.arange(n, device=x.device, dtype=x.dtype)[:, None] / n
        q, k, v = self.qkv(x + position).view(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        attention = (q @ k.transpose(-1, -2)).softmax(-1) @ v
        return self.out(attention.transpose(1, 2).reshape(b, n, c))


def test_an_exported_hosts_constants_and_ranges_follow_the_module() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(ShapeBranchingAttention(), nn.Linear(16, 16))
    original = copy.deepcopy(model)
    x = torch.randn(2, 5, 16)
    s = Surgeon(model, (x,))
    assert "export" in s.explain()
    s.remove(s.group("0:head"), 1)
    for module in (model, original):
        module.to("meta")
    assert model(x.to("meta")).shape == original(x.to("meta")).shape == (2, 5, 16)
    if torch.cuda.is_available():
        model.to_empty(device="cuda")
        assert model(x.cuda()).device.type == "cuda"


def _heads_removed(model: torch.nn.Module) -> Surgeon:
    s = Surgeon(model, (), {"input_ids": IDS})
    assert "export" in s.explain()  # the symbolic trace cannot take MPT: torch.export captured it
    s.remove(s.group("transformer.blocks.1.attn:head"), 1)
    return s


def test_an_exported_host_runs_where_the_model_is_moved() -> None:
    model = tiny_mpt()
    _heads_removed(model)
    with torch.no_grad():
        expected = model(input_ids=IDS).logits
    model.to("meta")  # the one other device every machine has: shapes only
    assert model(input_ids=IDS.to("meta")).logits.shape == expected.shape
    if torch.cuda.is_available():
        moved = tiny_mpt()
        _heads_removed(moved)
        moved.cuda()
        with torch.no_grad():
            got = moved(input_ids=IDS.cuda()).logits.cpu()
        assert (got - expected).abs().max() < 1e-8


def test_a_model_built_on_meta_is_analysed_as_on_the_cpu() -> None:
    on_cpu = analyse(tiny_mpt().float(), (), {"input_ids": IDS})
    with torch.device("meta"):
        built = transformers.MptForCausalLM(tiny_mpt().config)
    on_meta = analyse(built, (), {"input_ids": IDS.to("meta")})
    assert [(g.name, g.count) for g in on_meta.groups] == [(g.name, g.count) for g in on_cpu.groups]
    assert sum(g.kind == "head" for g in on_meta.groups) == 2


def test_an_exported_host_keeps_the_dtypes_it_was_captured_with() -> None:
    """The dtypes of the code's own tensors stay as captured (an upcast the code writes cannot be told from a dtype
    copied off an input): a model cast after its analysis fails with torch's dtype error, as the README says."""
    model = tiny_mpt().float()
    _heads_removed(model)
    model.double()
    with pytest.raises(RuntimeError, match="expected scalar type Float but found Double"):
        model(input_ids=IDS)
