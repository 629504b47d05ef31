"""Gated positional self-attention (ConViT's GPSA): each head mixes its content attention with a positional one made
by a linear map of a constant table of relative positions, weighted by a learned gate per head
(``(1 - sigmoid(g_h)) * softmax(q k^T)_h + sigmoid(g_h) * softmax(pos_proj(rel))_h``), then renormalised. The table
is cached in a buffer that the forward replaces at the first call of a new size (a branch on a size: the captured
graph serves). References come from the model's own layout (the output projection's columns of a head)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from test_fxsurgery_head_patterns import assert_head_oracles
from zoo import train_steps

import fxsurgery
from fxsurgery import AnalysisError, Surgeon

DIM, HEADS, HEAD_DIM, GRID = 8, 2, 4, 2
TOKENS = GRID * GRID
OUT = "attn.proj.weight"


class GatedPositionAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qk, self.v = nn.Linear(DIM, 2 * DIM, bias=False), nn.Linear(DIM, DIM, bias=False)
        self.proj, self.pos_proj = nn.Linear(DIM, DIM), nn.Linear(3, HEADS)
        self.gating_param = nn.Parameter(torch.randn(HEADS))
        self.register_buffer("rel_indices", torch.zeros(1, 1, 1, 3), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        if self.rel_indices.shape[1] != n:  # the table of relative positions, made at the first call of a size
            self.rel_indices = self.positions(n).to(x.dtype)
        q, k = self.qk(x).reshape(b, n, 2, HEADS, HEAD_DIM).permute(2, 0, 3, 1, 4)
        pos_score = self.pos_proj(self.rel_indices.expand(b, -1, -1, -1)).permute(0, 3, 1, 2).softmax(-1)
        patch_score = (q @ k.transpose(-2, -1) * HEAD_DIM ** -0.5).softmax(-1)
        gating = self.gating_param.view(1, -1, 1, 1)
        attn = (1. - torch.sigmoid(gating)) * patch_score + torch.sigmoid(gating) * pos_score
        attn /= attn.sum(dim=-1).unsqueeze(-1)
        v = self.v(x).reshape(b, n, HEADS, HEAD_DIM).permute(0, 2, 1, 3)
        return self.proj((attn @ v).transpose(1, 2).reshape(b, n, c))

    @staticmethod
    def positions(n: int) -> torch.Tensor:
        side = int(n ** .5)
        ind = torch.arange(side, dtype=torch.float32).view(1, -1) - torch.arange(side, dtype=torch.float32).view(-1, 1)
        indx = ind.repeat(side, side)
        indy = ind.repeat_interleave(side, dim=0).repeat_interleave(side, dim=1)
        return torch.stack([indx, indy, indx ** 2 + indy ** 2], -1).unsqueeze(0)


class Model(nn.Module):
    def __init__(self, attn: nn.Module):
        super().__init__()
        self.embed, self.attn, self.head = nn.Linear(5, DIM), attn, nn.Linear(DIM, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        return self.head((x + self.attn(x)).mean(1))


def _built(mode: str, warm: bool) -> tuple[nn.Module, torch.Tensor]:
    """The model in ``mode``; ``warm``: called once before, so its table is cached."""
    torch.manual_seed(0)
    model = getattr(Model(GatedPositionAttention()).double(), mode)()
    x = torch.randn(2, TOKENS, 5, dtype=torch.double)
    if warm:
        with torch.no_grad():
            model(x)
    return model, x


def _head(s: Surgeon) -> fxsurgery.UnitGroup:
    heads = [g for g in s.groups if g.kind == "head"]
    assert len(heads) == 1, s.explain()
    return heads[0]


@pytest.mark.parametrize("warm", [False, True])
@pytest.mark.parametrize("mode", ["eval", "train"])
def test_gated_heads_clone_unchanged_and_removal_equals_masking_and_tap(mode: str, warm: bool) -> None:
    original, x = _built(mode, warm)
    model = copy.deepcopy(original)
    s = Surgeon(model, (x,))
    head = _head(s)
    assert head.exact and head.count == HEADS and "torch.export" in s.explain()
    sliced = {sl.name: sl.dim for sl in head.slices}
    owned = {"attn.qk.weight": 0, "attn.v.weight": 0, "attn.pos_proj.weight": 0, "attn.pos_proj.bias": 0,
             "attn.gating_param": 0, OUT: 1}
    assert {k: sliced.get(k) for k in owned} == owned, s.explain()
    assert_head_oracles(original, model, s, x, out_weight=OUT, head_dim=HEAD_DIM, mode=mode)


def test_adam_state_follows_a_gated_head() -> None:
    model, x = _built("train", warm=False)
    s = Surgeon(model, (x,))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    s.attach_optimizer(opt)
    train_steps(model, opt, x)
    params = dict(model.named_parameters())
    before = {name: opt.state[params[name]]["exp_avg"].clone() for name in (OUT, "attn.pos_proj.weight",
                                                                           "attn.gating_param")}
    s.remove(_head(s), 0)
    params = dict(model.named_parameters())
    assert torch.equal(opt.state[params[OUT]]["exp_avg"], before[OUT][:, HEAD_DIM:])  # kept moments, bit-identical
    assert torch.equal(opt.state[params["attn.pos_proj.weight"]]["exp_avg"], before["attn.pos_proj.weight"][1:])
    assert torch.equal(opt.state[params["attn.gating_param"]]["exp_avg"], before["attn.gating_param"][1:])
    assert torch.isfinite(train_steps(model, opt, x))


class GrowingMemory(GatedPositionAttention):
    """A buffer replaced at every call by a longer one made from it: state a graph cannot keep."""

    def __init__(self):
        super().__init__()
        self.register_buffer("memory", torch.zeros(1, DIM), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        self.memory = torch.cat([self.memory, x.mean((0, 1))[None]])
        return y + self.memory.mean(0)


def test_a_buffer_grown_from_its_old_value_is_refused_naming_the_node() -> None:
    torch.manual_seed(0)
    model = Model(GrowingMemory()).double().eval()
    with pytest.raises(AnalysisError, match=r"attn: .*copy__\w+ replaces memory \(\d, 8\) with a tensor of shape "
                                            r"\(\d, 8\) made from its old value"):
        fxsurgery.analyse(model, (torch.randn(2, TOKENS, 5, dtype=torch.double),))


def test_timm_convit_is_analysed_without_writing_to_stderr(capsys) -> None:
    """timm's GPSA caches its position table at the first call: the analysis calls the model once first, so the
    GPSA block's heads are found beside the plain block's heads and both FFNs, and nothing is written to stderr."""
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("convit_tiny", img_size=32, patch_size=8, embed_dim=48, num_heads=4, depth=2,
                              local_up_to_layer=1, num_classes=3)
    s = Surgeon(model, (torch.randn(2, 3, 32, 32),))
    assert len(s.groups) == 4 and capsys.readouterr().err == ""
