"""The hosts' calls as the labelling of the traced model made them equal what a meta run of the model hands each
module (structure, shapes, strides, dtypes, plain values, one object where one tensor is passed twice); where the
labelling cannot tell a call, the meta run serves; and the analysis finds the same with either."""
from __future__ import annotations

import timm
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch.utils._pytree import tree_structure

from fxsurgery import Surgeon
from fxsurgery.analysis import model as model_plan
from fxsurgery.analysis.regions import find_regions, locate_hosts
from fxsurgery.capture.calls import capture_inputs
from fxsurgery.compat import tree_leaves


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads, self.qkv, self.proj = heads, nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, context: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        b, n, c = x.shape
        q = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)[0]
        kv = self.qkv(context).reshape(b, -1, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, kv[1], kv[2], scale=scale)
        return self.proj(out.transpose(1, 2).reshape(b, n, c))


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        h = F.gelu(self.fc1(x))
        return self.fc2(h if gate is None else h * gate)


class Block(nn.Module):
    """Calls its parts as users' blocks do: the same tensor twice, a keyword tensor, a plain float, a transposed
    (non-contiguous) input, and a size read (``x.shape``) handed on."""

    def __init__(self, dim: int, heads: int, hidden: int, transposed: bool, twice: bool, gated: bool):
        super().__init__()
        self.norm, self.attn, self.mlp = nn.LayerNorm(dim), Attention(dim, heads), Mlp(dim, hidden)
        self.transposed, self.twice, self.gated = transposed, twice, gated
        self.gate = nn.Parameter(torch.rand(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(x)
        context = y if self.twice else y.flip(1)
        if self.transposed:  # the same values, laid out token-major: a strided input
            context = context.transpose(0, 1).contiguous().transpose(0, 1)
        x = x + self.attn(y, context=context, scale=0.5)
        return x + self.mlp(self.norm(x), gate=self.gate if self.gated else None)


class Model(nn.Module):
    def __init__(self, depth: int, **block: object):
        super().__init__()
        self.blocks = nn.Sequential(*[Block(**block) for _ in range(depth)])
        self.head = nn.Linear(block["dim"], 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x).mean(1))


def described(call: tuple[tuple, dict]) -> tuple:
    """A call's structure, each tensor's shape, strides and dtype, each plain value, and which leaves are one object."""
    leaves = tree_leaves(call)
    first = {}
    return (tree_structure(call),
            [(tuple(t.shape), t.stride(), t.dtype) if torch.is_tensor(t) else (type(t), t) for t in leaves],
            [first.setdefault(id(t), k) for k, t in enumerate(leaves) if torch.is_tensor(t)])


def traced_and_captured(model: nn.Module, x: torch.Tensor) -> tuple[dict, dict, list[str]]:
    """The calls the labelling tells (by module), a meta run's calls of every module, and the modules it cannot tell."""
    regions, _ = find_regions(model, ((x,), {}), lambda *a: None)
    _, traced = locate_hosts(model, regions, lambda *a: None)
    told, untold = {}, []
    for name, call in traced.items():
        try:
            told[name] = call.values()
        except LookupError:
            untold.append(name)
    names = [name for name, _ in model.named_modules() if name]
    return told, capture_inputs(model, ((x,), {}), names), untold


@given(depth=st.integers(1, 3), heads=st.sampled_from([1, 2]), batch=st.integers(1, 3), tokens=st.integers(1, 5),
       transposed=st.booleans(), twice=st.booleans(), gated=st.booleans(), dtype=st.sampled_from([torch.float32,
                                                                                                  torch.float64]))
def test_the_calls_the_labelling_tells_equal_a_meta_run_s(depth, heads, batch, tokens, transposed, twice, gated,
                                                          dtype) -> None:
    model = Model(depth, dim=8, heads=heads, hidden=12, transposed=transposed, twice=twice, gated=gated).to(dtype)
    told, captured, untold = traced_and_captured(model, torch.randn(batch, tokens, 8, dtype=dtype))
    assert not untold
    assert set(told) == set(captured)  # every module called, each told
    for name, call in told.items():
        assert described(call) == described(captured[name]), name
    context = told["blocks.0.attn"][1]["context"]  # a strided input is told with its strides
    assert context.is_contiguous() == (not transposed or batch == 1 or tokens == 1)


class SizeHandedOn(nn.Module):
    """A size read (``x.shape``, made into a node only when used) handed to a submodule: the labelling cannot tell
    that call, the meta run serves it."""

    def __init__(self):
        super().__init__()
        self.inner, self.attn = Sized(), Attention(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(self.attn(x, context=x), x.shape)


class Sized(nn.Module):
    def forward(self, x: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        return x.reshape(shape)


def test_a_call_the_labelling_cannot_tell_is_captured() -> None:
    model = SizeHandedOn()
    told, captured, untold = traced_and_captured(model, torch.randn(2, 3, 8))
    assert "inner" not in told and "attn" in told and "inner" in captured and not untold
    assert described(told["attn"]) == described(captured["attn"])


def tiny_vit() -> nn.Module:
    return timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=32, depth=3, num_heads=2,
                             num_classes=5)


def test_an_analysis_finds_the_same_with_the_calls_captured(monkeypatch) -> None:
    torch.manual_seed(0)
    make = tiny_vit
    x = torch.randn(2, 3, 32, 32)
    captures = []
    fast = Surgeon(make(), (x,))
    real_capture = model_plan.capture_inputs
    monkeypatch.setattr(model_plan, "capture_inputs", lambda *a: captures.append(a[2]) or real_capture(*a))
    told = Surgeon(make(), (x,))
    assert captures == []  # every host's call and its callers' were told by the labelling
    locate = model_plan.locate_hosts
    monkeypatch.setattr(model_plan, "locate_hosts", lambda *a: locate(*a)._replace(calls={}))
    captured = Surgeon(make(), (x,))
    assert captures and captures[-1]  # the meta run served them
    for other in (told, captured):
        assert other.explain() == fast.explain() and other.left_out == fast.left_out
        assert [(g.name, g.count, g.slices) for g in other.groups] == [(g.name, g.count, g.slices) for g in fast.groups]


@torch.fx.wrap
def kept_tokens(x: torch.Tensor) -> torch.Tensor:
    """The tokens up to the last whose first feature is finite: read from the data (no meta run can)."""
    return x[:, :int(torch.isfinite(x[0, :, 0]).sum())]


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn, self.mlp = Attention(8, 2), Mlp(8, 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = kept_tokens(x)
        x = x + self.attn(x, context=x)
        return x + self.mlp(x)


def test_a_graph_labelled_for_real_tells_no_call_and_the_model_s_run_records_them(monkeypatch) -> None:
    """Where the labelling runs for real (data-dependent code), a call's tensors would need their data: the run of
    the model records them."""
    torch.manual_seed(0)
    model, x = DataDependent(), torch.randn(2, 5, 8)
    regions, _ = find_regions(model, ((x,), {}), lambda *a: None)
    _, traced = locate_hosts(model, regions, lambda *a: None)
    assert traced == {}
    recorded = []
    real_capture = model_plan.capture_inputs
    monkeypatch.setattr(model_plan, "capture_inputs", lambda *a: recorded.append(a[2]) or real_capture(*a))
    surgeon = Surgeon(model, (x,))
    assert recorded == [["attn", "mlp"]] and {g.module for g in surgeon.groups} == {"attn", "mlp"}
