"""fxsurgery on patterns beyond the conformance lists: inferred head sizes, layers of one unit,
parameters shared by every block, fused parallel blocks, tokens routed by a data-dependent index."""
from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from zoo import Style, TinyTransformer, train_steps

import fxsurgery
from fxsurgery import Surgeon


class MinusOneAttention(nn.Module):
    """Fused q/k/v split into heads with ``view(b, n, heads, -1)``: the head size is inferred."""

    def __init__(self, dim: int = 12, heads: int = 3):
        super().__init__()
        self.h = heads
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q, k, v = (t.view(b, n, self.h, -1).transpose(1, 2) for t in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v)
        return self.out(o.transpose(1, 2).reshape(b, n, -1))


def test_view_with_minus_one_reaches_zero_heads_and_trains() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 12), MinusOneAttention(), nn.LayerNorm(12), nn.Linear(12, 3))
    x = torch.randn(2, 4, 5)
    s = Surgeon(model, (x,))
    head = next(g for g in s.groups if g.kind == "head")
    assert (head.count, head.min_count) == (3, 0) and not head.notes
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    s.attach_optimizer(opt)
    train_steps(model, opt, x)
    while head.count:
        s.remove(head, 0)
    assert model[1].qkv.weight.shape[0] == 0
    assert torch.isfinite(train_steps(model, opt, x))
    assert model(torch.randn(3, 7, 5)).shape == (3, 7, 3)  # other batch and token counts still run


def test_one_channel_ffn_is_a_group_that_receives() -> None:
    torch.manual_seed(0)
    model = TinyTransformer(Style(mlp_hidden=1, depth=2)).double()
    x = torch.randn(3, 6, 5, dtype=torch.double)
    s = Surgeon(model, (x,))
    ffn = [g for g in s.groups if g.kind == "channel"]
    assert [(g.module, g.count, g.min_count) for g in ffn] == [("blocks.0.mlp", 1, 1), ("blocks.1.mlp", 1, 1)]
    with torch.no_grad():
        y0 = model(x)
    for g in ffn:
        s.clone(g, 0, noise_std=0.1)
    with torch.no_grad():
        assert (model(x) - y0).abs().max() <= 1e-9
    assert model.blocks[0].mlp.fc1.weight.shape[0] == 2 and model.blocks[0].mlp.fc2.in_features == 2


def test_compact_model_analysed_again_at_one_unit() -> None:
    """A model operated down to one FFN channel and one head, then wrapped again: both are groups that can
    receive (clones keep the outputs) and donate (the head reaches zero heads as masking its columns does)."""
    torch.manual_seed(0)
    model = TinyTransformer(Style(heads=3, mlp_hidden=4, depth=1)).double()
    x = torch.randn(3, 6, 5, dtype=torch.double)
    s = Surgeon(model, (x,))
    for g in s.groups:
        s.keep(g, [1])
    again = Surgeon(model, (x,))
    ffn, head = again.group("blocks.0.mlp:channel"), again.group("blocks.0.attn:head")
    assert ffn.count == 1 and head.count == 1 and head.exact and head.min_count == 0
    with torch.no_grad():
        y0 = model(x)
    again.clone(ffn, 0, noise_std=0.1)
    again.clone(head, 0, noise_std=0.1)
    assert head.count == 2
    with torch.no_grad():
        assert (model(x) - y0).abs().max() <= 1e-9
        masked = copy.deepcopy(model)
        masked.blocks[0].attn.proj.weight.zero_()
        again.remove(head, 0)
        again.remove(head, 0)
        assert head.count == 0
        assert (model(x) - masked(x)).abs().max() <= 1e-9


class RelAttn(nn.Module):
    """Attention whose logits get the shared MLP's bias; the MLP is held in a list, not as a submodule."""

    def __init__(self, dim: int, heads: int, rel: nn.Module):
        super().__init__()
        self.h, self.rel = heads, [rel]
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.h, c // self.h).permute(2, 0, 3, 1, 4).unbind(0)
        a = (q @ k.transpose(-2, -1) * (c // self.h) ** -0.5 + self.rel[0].bias_for(n)).softmax(-1)
        return self.proj((a @ v).transpose(1, 2).reshape(b, n, c))


class RelMlp(nn.Module):
    """(heads, n, n) attention bias from relative positions."""

    def __init__(self, heads: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(2, 16), nn.Linear(16, heads)

    def bias_for(self, n: int) -> torch.Tensor:
        pos = torch.arange(n, dtype=torch.float32)
        rel = pos[:, None] - pos[None, :]
        return self.fc2(F.relu(self.fc1(torch.stack([rel, rel.abs()], -1)))).permute(2, 0, 1)


class SharedRelativeBias(nn.Module):
    """Every block adds a per-head bias from one relative-position MLP (a module all blocks call)."""

    def __init__(self, dim: int = 12, heads: int = 3, depth: int = 2):
        super().__init__()
        self.embed, self.rel = nn.Linear(5, dim), RelMlp(heads)
        self.attns = nn.ModuleList(RelAttn(dim, heads, self.rel) for _ in range(depth))
        self.head = nn.Linear(dim, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for attn in self.attns:
            x = x + attn(x)
        return self.head(x.mean(1))


class Parallel(nn.Module):
    """One Linear gives q, k, v and the MLP hidden; outputs read by separate projections or a fused one."""

    def __init__(self, dim: int = 12, heads: int = 3, hidden: int = 8, fused_out: bool = False):
        super().__init__()
        self.h, self.hidden, self.fused_out = heads, hidden, fused_out
        self.in_proj = nn.Linear(dim, 3 * dim + hidden)
        if fused_out:
            self.out = nn.Linear(dim + hidden, dim)
        else:
            self.attn_out, self.mlp_out = nn.Linear(dim, dim), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        qkv, h = torch.split(self.in_proj(x), [3 * c, self.hidden], dim=-1)
        q, k, v = qkv.reshape(b, n, 3, self.h, c // self.h).permute(2, 0, 3, 1, 4).unbind(0)
        o = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, c)
        if self.fused_out:
            return x + self.out(torch.cat([o, F.gelu(h)], -1))
        return x + self.attn_out(o) + self.mlp_out(F.gelu(h))


class ParallelModel(nn.Module):
    def __init__(self, fused_out: bool):
        super().__init__()
        self.embed, self.head = nn.Linear(5, 12), nn.Linear(12, 3)
        self.blocks = nn.Sequential(*[Parallel(fused_out=fused_out) for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(x)).mean(1))


def test_heads_biased_by_a_module_every_block_calls_are_one_head_index_over_the_blocks() -> None:
    """A per-head score bias from one MLP that every block calls ties head h of every block to row h of its last
    map: one group whose unit is that head index in every block (as T5's shared bias). Removing head 1 equals
    zeroing its output-projection columns in every block and equals zeroing it at the tap; the MLP's hidden channels
    are a group of their own; a clone leaves the outputs unchanged."""
    torch.manual_seed(0)
    model, x = SharedRelativeBias(), torch.randn(2, 6, 5)  # the MLP reads float32 positions
    zeroed, original = copy.deepcopy(model), copy.deepcopy(model)
    s = Surgeon(model, (x,))
    assert sorted((g.kind, g.count, g.exact) for g in s.groups) == [("channel", 16, True), ("head", 3, True)]
    heads = next(g for g in s.groups if g.kind == "head")
    channels = next(g for g in s.groups if g.kind == "channel")
    assert {sl.name for sl in channels.slices} == {"rel.fc1.weight", "rel.fc1.bias", "rel.fc2.weight"}
    assert {"attns.0.proj.weight", "attns.1.proj.weight", "rel.fc2.weight", "rel.fc2.bias"} <= \
        {sl.name for sl in heads.slices}
    with torch.no_grad():
        for attn in zeroed.attns:
            attn.proj.weight[:, 4:8] = 0
        handle = s.tap(heads, lambda a: a.select(-2, 1).zero_())
        tapped = model(x)
        handle.remove()
        s.remove(heads, 1)
        removed = model(x)
        assert (removed - zeroed(x)).abs().max() <= 1e-6 and (removed - tapped).abs().max() <= 1e-6
        assert not torch.allclose(removed, original(x), atol=1e-4)
        assert model.rel.fc2.weight.shape == (2, 16) and model.attns[1].proj.weight.shape == (12, 8)
    s.clone(heads, 0, noise_std=0.1)
    s.clone(channels, 3, noise_std=0.1)
    with torch.no_grad():
        assert (model(x) - removed).abs().max() <= 1e-5


class PositionConvBlock(nn.Module):
    """A block that adds a depthwise convolution of the stream, a module every block calls (CoaT's position
    convolution), before its attention and FFN."""

    def __init__(self, dim: int, position: nn.Module):
        super().__init__()
        self.position = [position]
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 8), nn.Linear(8, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.position[0](x.transpose(1, 2)).transpose(1, 2)
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, 3, c // 3).permute(2, 0, 3, 1, 4).unbind(0)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, c))
        return x + self.fc2(F.gelu(self.fc1(x)))


class SharedPositionConv(nn.Module):
    def __init__(self, dim: int = 12, depth: int = 6):
        super().__init__()
        self.embed, self.position = nn.Linear(5, dim), nn.Conv1d(dim, dim, 3, padding=1, groups=dim)
        self.blocks = nn.ModuleList(PositionConvBlock(dim, self.position) for _ in range(depth))
        self.head = nn.Linear(dim, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(1))


def test_units_tied_through_a_module_every_block_calls_are_told_in_one_short_line() -> None:
    """At any depth the refusal names three other blocks and the shared parameter and says how many more (CoaT's
    stages, whose blocks all call one position convolution, named dozens of blocks and parameters in one line)."""
    torch.manual_seed(0)
    s = Surgeon(SharedPositionConv(), (torch.randn(2, 6, 5),))
    assert sorted(g.name for g in s.groups) == sorted(f"blocks.{i}:{kind}" for i in range(6)
                                                      for kind in ("head", "channel"))
    reasons = [r for lo in s.left_out if lo.module == "blocks.0" for r in lo.reasons]
    assert any(re.match(r"units tied to those of \(model\), blocks\.1, blocks\.2 and \d more through ", r) and
               "position.weight" in r and len(r) < 250 for r in reasons), reasons


@pytest.mark.parametrize("fused_out", [False, True])
def test_fused_parallel_blocks_give_heads_and_channels_apart(fused_out: bool) -> None:
    """One projection makes q, k, v and the MLP hidden: its heads and channels are two groups in segments of its
    rows (tests/fxsurgery/test_fxsurgery_fused_parallel.py checks their edits against the block's own layout)."""
    torch.manual_seed(0)
    x = torch.randn(2, 6, 5)
    s = Surgeon(ParallelModel(fused_out=fused_out), (x,))
    assert sorted((g.name, g.count, g.exact) for g in s.groups) == [
        (f"blocks.{i}:{kind}", count, True) for i in range(2) for kind, count in (("channel", 8), ("head", 3))]


class ResampledBias(nn.Module):
    """Attention with a per-head bias table resampled to the token grid by ``F.interpolate``."""

    def __init__(self, heads: int = 3, head_dim: int = 4, dim: int = 8):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * heads * head_dim)
        self.proj = nn.Linear(heads * head_dim, dim)
        self.table = nn.Parameter(torch.randn(1, heads, 3, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        bias = F.interpolate(self.table, size=(n, n), mode="bilinear", align_corners=False)
        attn = (q @ k.transpose(-2, -1) + bias).softmax(-1)
        return x + self.proj((attn @ v).transpose(1, 2).reshape(b, n, -1))


@pytest.mark.parametrize("removed", [0, 1, 2])
def test_a_resampled_per_head_table_follows_its_heads(removed: int) -> None:
    torch.manual_seed(0)
    model = ResampledBias().double()
    masked = ResampledBias().double()
    masked.load_state_dict(model.state_dict())
    x = torch.randn(2, 5, 8, dtype=torch.double)
    s = Surgeon(model, (x,))
    (head,) = s.groups
    assert "table" in {sl.name for sl in head.slices}
    s.remove(head, removed)
    with torch.no_grad():
        masked.proj.weight[:, 4 * removed: 4 * removed + 4] = 0
        assert (model(x) - masked(x)).abs().max() <= 1e-12


class UnprojectedHeads(nn.Module):
    """Blocks whose one-head attention has no output projection (its head is as wide as the stream it is
    added to), each followed by an FFN; then a classifier."""

    def __init__(self, dim: int = 6, depth: int = 2):
        super().__init__()
        self.qkv = nn.ModuleList(nn.Linear(dim, 3 * dim) for _ in range(depth))
        self.ffn = nn.ModuleList(nn.Sequential(nn.Linear(dim, 5), nn.GELU(), nn.Linear(5, dim)) for _ in range(depth))
        self.head = nn.Linear(dim, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for qkv, ffn in zip(self.qkv, self.ffn):
            q, k, v = qkv(x).unsqueeze(1).chunk(3, dim=-1)
            x = x + F.scaled_dot_product_attention(q, k, v).squeeze(1)
            x = x + ffn(x)
        return self.head(x)


def test_heads_without_an_output_projection_are_told_as_the_stream_width() -> None:
    """Such heads cannot be removed by slicing; the report says why, and the FFNs stay groups."""
    torch.manual_seed(0)
    s = Surgeon(UnprojectedHeads(), (torch.randn(2, 4, 6),))
    assert [g.kind for g in s.groups] == ["channel", "channel"]
    reasons = " ".join(r for lo in s.left_out for r in lo.reasons)
    assert "no output projection of their own: their values are the width of the stream they join" in reasons


class RoutedTokens(nn.Module):
    """A router sends tokens to an expert: the tokens are gathered by an index computed from the data
    (``h[token]``, which the labelling by shapes alone sees as a meta tensor), run through the expert's FFN and
    added back with ``index_add``. ``permute``: the stream's features are also reordered by a data-dependent index,
    whose values the ids need (a permutation of features, unlike a pick of tokens, moves the ids)."""

    def __init__(self, dim: int = 6, hidden: int = 5, permute: bool = False):
        super().__init__()
        self.permute = permute
        self.inp, self.router = nn.Linear(3, dim), nn.Linear(dim, 2)
        self.fc1, self.fc2, self.out = nn.Linear(dim, hidden), nn.Linear(hidden, dim), nn.Linear(dim, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x).reshape(-1, self.inp.out_features)
        if self.permute:
            h = h[:, h.detach().sum(0).argsort()]
        token = self.router(h)[:, 0].argsort()[:4]  # the four tokens that score the first expert lowest
        picked = h[token]
        routed = torch.zeros_like(h).index_add(0, token, self.fc2(F.gelu(self.fc1(picked))))
        return self.out(h + routed)


@pytest.mark.parametrize("permute", [False, True])
def test_tokens_picked_by_a_data_dependent_index_keep_their_expert_channels(permute: bool) -> None:
    torch.manual_seed(0)
    model, x = RoutedTokens(permute=permute).double(), torch.randn(2, 7, 3, dtype=torch.double)
    masked = copy.deepcopy(model)
    s = Surgeon(model, (x,))
    assert "failed" not in s.explain(), s.explain()  # no unforeseen error refused the graph
    (ffn,) = s.groups  # the expert's channels (the index_add is told: no rule)
    assert (ffn.kind, ffn.count, ffn.exact) == ("channel", 5, True)
    with torch.no_grad():
        s.remove(ffn, 1)
        masked.fc2.weight[:, 1] = 0
        assert (model(x) - masked(x)).abs().max() <= 1e-9


class AliasAttention(nn.Module):
    """Attention written with the NumPy-style aliases (``torch.multiply``, ``Tensor.divide``, ``torch.subtract``),
    as some transformers models write it: heads are found through them as through ``*``, ``/`` and ``-``."""

    def __init__(self, dim: int = 12, heads: int = 3):
        super().__init__()
        self.h, self.d = heads, dim // heads
        self.q, self.k, self.v, self.out = (nn.Linear(dim, dim) for _ in range(4))
        self.gate = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = (p(x).view(b, n, self.h, self.d).transpose(1, 2) for p in (self.q, self.k, self.v))
        scores = torch.multiply(q, self.d ** -0.5) @ k.transpose(-1, -2)
        weights = torch.subtract(scores, scores.amax(-1, keepdim=True)).exp()
        weights = weights.divide(weights.sum(-1, keepdim=True))
        mixed = (weights @ v).transpose(1, 2).reshape(b, n, -1)
        return self.out(mixed.multiply(torch.sigmoid(self.gate(x))))


class MaxStabilisedAttention(nn.Module):
    """A softmax written out, stabilised by ``scores.max(dim=-1, keepdim=True).values`` and with ``torch.max`` of
    two tensors as a floor: heads are found through both forms of ``max``."""

    def __init__(self, dim: int = 12, heads: int = 3):
        super().__init__()
        self.h, self.d = heads, dim // heads
        self.q, self.k, self.v, self.out = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = (p(x).view(b, n, self.h, self.d).transpose(1, 2) for p in (self.q, self.k, self.v))
        scores = q @ k.transpose(-1, -2) * self.d ** -0.5
        weights = (scores - scores.max(dim=-1, keepdim=True).values).exp()
        weights = weights / weights.sum(-1, keepdim=True)
        mixed = torch.max(weights @ v, torch.full_like(v, -3.0))
        return self.out(mixed.transpose(1, 2).reshape(b, n, -1))


@pytest.mark.parametrize("attention", [AliasAttention, MaxStabilisedAttention])
@pytest.mark.parametrize("removed", [0, 2])
def test_heads_are_found_through_aliases_and_max_and_removal_equals_masking(attention: type, removed: int) -> None:
    """The NumPy-style aliases (multiply, subtract, divide) and both forms of ``max`` are elementwise or reduce
    over the keys: the three heads are found, and removing one equals zeroing its output-projection columns."""
    torch.manual_seed(0)
    model = nn.Sequential(attention(), nn.Linear(12, 3))
    masked = copy.deepcopy(model)
    x = torch.randn(2, 4, 12)
    s = Surgeon(model, (x,))
    head = next(g for g in s.groups if g.kind == "head")
    assert head.count == 3 and head.exact
    s.remove(head, removed)
    with torch.no_grad():
        masked[0].out.weight[:, 4 * removed:4 * removed + 4] = 0
    torch.testing.assert_close(model(x), masked(x), rtol=1e-5, atol=1e-6)


class WeightsReturningAttention(nn.Module):
    """Returns its per-head attention weights beside its output, as many transformers attention modules do."""

    def __init__(self, dim: int = 12, heads: int = 3):
        super().__init__()
        self.h, self.d = heads, dim // heads
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.h, self.d).permute(2, 0, 3, 1, 4)
        weights = (q @ k.transpose(-1, -2) * self.d ** -0.5).softmax(-1)
        return self.out((weights @ v).transpose(1, 2).reshape(b, n, -1)), weights


class WeightsHandingBlock(nn.Module):
    """A block that hands its attention's weights on to its caller."""

    def __init__(self, dim: int = 12):
        super().__init__()
        self.norm, self.attn, self.mlp = nn.LayerNorm(dim), WeightsReturningAttention(dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        attended, weights = self.attn(self.norm(x))
        x = x + attended
        return x + self.mlp(x), weights


class WeightsDroppingModel(nn.Module):
    """Its blocks hand their attention weights on; it drops them."""

    def __init__(self, dim: int = 12):
        super().__init__()
        self.blocks, self.head = nn.ModuleList(WeightsHandingBlock(dim) for _ in range(2)), nn.Linear(dim, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x, _ = block(x)
        return self.head(x)


def test_heads_whose_weights_blocks_hand_on_are_found_where_a_caller_drops_them() -> None:
    torch.manual_seed(0)
    model = WeightsDroppingModel()
    masked = copy.deepcopy(model)
    x = torch.randn(2, 4, 12)
    s = Surgeon(model, (x,))
    heads = [g for g in s.groups if g.kind == "head"]
    assert [g.count for g in heads] == [3, 3] and all(g.exact for g in heads)
    s.remove(heads[1], 0)
    with torch.no_grad():
        masked.blocks[1].attn.out.weight[:, :4] = 0  # head 0's columns of the second block's output projection
    torch.testing.assert_close(model(x), masked(x), rtol=1e-5, atol=1e-6)


class ProductAttention(nn.Module):
    """Attention whose maps are products with parameters (``x @ W``, einops-style code), or through F.linear, or
    products with a weight the code computes (``x @ (W * mask)``, which no edit can slice); ``table``, an einsum with
    a parameter inside the attention (a relative-position table read through the query, its heads kept apart),
    lays out the keys' positions."""

    def __init__(self, dim: int = 12, heads: int = 3, style: str = "products"):
        super().__init__()
        self.h, self.d, self.style = heads, dim // heads, style
        self.w_q, self.w_k, self.w_v, self.w_o = (nn.Parameter(torch.randn(dim, dim) / dim ** 0.5) for _ in range(4))
        self.table = nn.Parameter(torch.randn(4, dim // heads))
        self.gate = nn.Parameter(torch.rand(dim, dim))

    def map(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if self.style == "linear":
            return F.linear(x, w)
        return x @ (w * self.gate) if self.style == "computed" else x @ w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = (self.map(x, w).view(b, n, self.h, self.d).transpose(1, 2) for w in (self.w_q, self.w_k, self.w_v))
        scores = q @ k.transpose(-1, -2) + torch.einsum("bhnd,md->bhnm", q, self.table)
        mixed = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, -1)
        return self.map(mixed, self.w_o)


class ProductBlock(nn.Module):
    def __init__(self, style: str):
        super().__init__()
        self.embed, self.attn = nn.Linear(3, 12), ProductAttention(style=style)
        self.fc1, self.fc2 = nn.Linear(12, 24), nn.Linear(24, 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        x = x + self.attn(x)
        return x + self.fc2(F.gelu(self.fc1(x)))


def test_a_linear_map_written_as_a_product_with_a_parameter_starts_its_space_as_f_linear_does() -> None:
    """``x @ W`` is the linear map F.linear is: the attention's heads are found alike, slicing W's columns (its own
    dim) for the heads the product makes and W's rows where it reads them; removal equals zeroing the head's rows
    of the output map (``mixed @ w_o``) and equals zeroing the head through the tap, a clone keeps the outputs. The
    einsum with the position table, whose query heads are kept apart, is read by every head and starts nothing. A
    product with a weight the code computes starts no space and is told at its module, naming the product."""
    torch.manual_seed(0)
    x = torch.randn(2, 4, 3, dtype=torch.double)
    found = {style: fxsurgery.analyse(ProductBlock(style).double(), (x,)) for style in ("products", "linear")}
    for analysis in found.values():
        assert [(g.kind, g.count, g.exact) for g in analysis.groups] == [("head", 3, True), ("channel", 24, True)]
        assert not [r for lo in analysis.left_out for r in lo.reasons if "starts no unit space" in r]
    (heads, _) = found["products"].groups
    assert {(sl.name, sl.dim) for sl in heads.slices} >= {("attn.w_q", 1), ("attn.w_o", 0)}
    original = ProductBlock("products").double()
    model = copy.deepcopy(original)
    s = Surgeon(model, (x,))
    group = next(g for g in s.groups if g.kind == "head")
    masked = copy.deepcopy(original)
    with torch.no_grad():
        masked.attn.w_o[4:8] = 0  # head 1's rows of the output map

        def zero_head(a: torch.Tensor) -> None:
            a[..., 1, :] = 0  # (*lead, count, per_unit)
        tap = s.tap(group, zero_head)
        by_tap = model(x)
        tap.remove()
        s.remove(group, 1)
        removed = model(x)
        torch.testing.assert_close(removed, masked(x), rtol=0, atol=1e-12)
        torch.testing.assert_close(removed, by_tap, rtol=0, atol=1e-12)
        s.clone(group, 0, noise_std=0.1, generator=torch.Generator().manual_seed(0))
        torch.testing.assert_close(model(x), removed, rtol=0, atol=1e-12)
    computed = fxsurgery.analyse(ProductBlock("computed"), (x.float(),))
    assert [g.kind for g in computed.groups] == ["channel"]
    told = [r for lo in computed.left_out if lo.module == "attn" for r in lo.reasons]
    assert any(r.startswith("matmul: multiplies by the parameter") and "starts no unit space" in r for r in told), told


