"""A tensor the code computes, broadcast along the heads by an ``expand`` (a token-type mask read by every head, as
Funnel Transformer's relative token-type attention does: ``torch.where(mask.expand(b, heads, n, n), same, diff)``),
is the same for every head: a head's slice of it is the tensor smaller, so it does not keep the heads from being
units. One that differs from head to head still refuses them, at its expand. References come from the output
projection's columns of a head, never from fxsurgery's slices."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from fxsurgery import AnalysisError, Surgeon, UnitGroup

DIM, HEADS, HEAD_DIM, TOKENS = 8, 4, 3, 5
INNER = HEADS * HEAD_DIM


class TokenTypeAttention(nn.Module):
    """Content scores plus a per-head bias picked, position pair by position pair, by a token-type mask the code
    computes and broadcasts to every head (its head count read off the queries, or written as a literal)."""

    def __init__(self, literal: bool = False) -> None:
        super().__init__()
        self.literal = literal
        self.q, self.k, self.v = (nn.Linear(DIM, INNER) for _ in range(3))
        self.seg_embed = nn.Parameter(torch.randn(2, HEADS, HEAD_DIM))
        self.out = nn.Linear(INNER, DIM)

    def forward(self, x: torch.Tensor, token_types: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = (p(x).view(b, n, HEADS, HEAD_DIM) for p in (self.q, self.k, self.v))
        scores = torch.einsum("bind,bjnd->bnij", q, k)
        bias = torch.einsum("bind,snd->bnis", q, self.seg_embed)
        same = token_types[:, :, None] == token_types[:, None]
        heads = HEADS if self.literal else q.shape[2]
        same = same[:, None].expand([b, heads, n, n])
        differ_bias, same_bias = torch.split(bias, 1, dim=-1)
        scores = scores + torch.where(same, same_bias.expand(same.shape), differ_bias.expand(same.shape))
        attended = torch.einsum("bnij,bjnd->bind", scores.softmax(-1), v)
        return x + self.out(attended.reshape(b, n, INNER))


class PerHeadChoice(TokenTypeAttention):
    """The same, with a choice the code computes that differs from head to head."""

    def forward(self, x: torch.Tensor, token_types: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k = (p(x).view(b, n, HEADS, HEAD_DIM) for p in (self.q, self.k))
        scores = torch.einsum("bind,bjnd->bnij", q, k)
        odd = (torch.arange(HEADS) % 2 == 1).view(1, HEADS, 1, 1).expand(b, HEADS, n, n)
        scores = torch.where(odd, scores, -scores)
        v = self.v(x).view(b, n, HEADS, HEAD_DIM)
        return x + self.out(torch.einsum("bnij,bjnd->bind", scores.softmax(-1), v).reshape(b, n, INNER))


class BroadcastPositions(TokenTypeAttention):
    """Content scores plus position scores: a table the code computes, broadcast over the batch by an ``expand`` and
    mapped to every head by a (features, heads, head_dim) parameter (XLNet's ``einsum("ibh,hnd->ibnd", pos, r)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.r = nn.Parameter(torch.randn(DIM, HEADS, HEAD_DIM))

    def forward(self, x: torch.Tensor, token_types: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = (p(x).view(b, n, HEADS, HEAD_DIM) for p in (self.q, self.k, self.v))
        table = (torch.arange(n, dtype=x.dtype)[:, None] * torch.arange(1, DIM + 1, dtype=x.dtype)).sin()
        positions = torch.einsum("bjh,hnd->bjnd", table[None].expand(b, -1, -1), self.r)
        scores = torch.einsum("bind,bjnd->bnij", q, k) + torch.einsum("bind,bjnd->bnij", q, positions)
        attended = torch.einsum("bnij,bjnd->bind", scores.softmax(-1), v)
        return x + self.out(attended.reshape(b, n, INNER))


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return (torch.randn(2, TOKENS, DIM, dtype=torch.float64, generator=generator),
            torch.randint(0, 2, (2, TOKENS), generator=generator))


def _only_head(s: Surgeon) -> UnitGroup:
    heads = [g for g in s.groups if g.kind == "head"]
    assert [(g.count, g.exact) for g in heads] == [(HEADS, True)], s.explain()
    return heads[0]


def assert_head_1_removal_equals_masking(model: nn.Module, call: dict, *, projection: str, logits,
                                         tol: float = 1e-10) -> None:
    """Removing head 1 equals zeroing its columns of ``projection`` (on a copy) and equals zeroing it at the tap;
    it changes the outputs; cloning head 0 afterwards keeps them. ``logits`` reads the outputs of a call."""
    zeroed = copy.deepcopy(model)
    with torch.no_grad():
        reference = logits(model(**call))
        zeroed.get_parameter(projection)[:, HEAD_DIM:2 * HEAD_DIM] = 0
        by_weights = logits(zeroed(**call))
    s = Surgeon(model, (), call)
    heads = _only_head(s) if len([g for g in s.groups if g.kind == "head"]) == 1 else \
        next(g for g in s.groups if g.kind == "head" and projection.startswith(g.name.split(":")[0]))
    handle = s.tap(heads, lambda a: a.select(-2, 1).zero_())
    with torch.no_grad():
        tapped = logits(model(**call))
    handle.remove()
    s.remove(heads, 1)
    assert heads.count == HEADS - 1
    with torch.no_grad():
        removed = logits(model(**call))
    assert (removed - by_weights).abs().max() < tol and (removed - tapped).abs().max() < tol
    assert not torch.allclose(removed, reference, atol=1e-6)
    s.clone(heads, 0, noise_std=0.1)
    with torch.no_grad():
        assert (logits(model(**call)) - removed).abs().max() < tol


@pytest.mark.parametrize("literal", [False, True], ids=["count read off the queries", "count written as a literal"])
def test_a_computed_mask_broadcast_to_every_head_leaves_the_heads_units(literal: bool) -> None:
    x, token_types = _inputs()
    model = TokenTypeAttention(literal).double().eval()
    assert_head_1_removal_equals_masking(model, {"x": x, "token_types": token_types}, projection="out.weight",
                                         logits=lambda out: out)


def test_a_computed_choice_that_differs_between_heads_still_refuses_them() -> None:
    x, token_types = _inputs()
    with pytest.raises(AnalysisError, match=r"expand.*a tensor the code computes .* lines up with the unit axis"):
        Surgeon(PerHeadChoice().double(), (x, token_types))


def test_a_computed_table_broadcast_over_the_batch_and_mapped_by_a_parameter_leaves_the_heads_units() -> None:
    """A product reads a broadcast table as the plain tensor it is: mapped by a parameter, it starts the position
    heads that the queries read, as it does unbroadcast."""
    x, token_types = _inputs()
    assert_head_1_removal_equals_masking(BroadcastPositions().double().eval(), {"x": x, "token_types": token_types},
                                         projection="out.weight", logits=lambda out: out)


def tiny_funnel(cls_name: str) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.FunnelConfig(vocab_size=64, block_sizes=[1, 1], num_decoder_layers=1, d_model=DIM * 2,
                                       n_head=HEADS, d_head=HEAD_DIM, d_inner=24, max_position_embeddings=32)
    model = getattr(transformers, cls_name)(config).double().eval()
    with torch.no_grad():  # the relative-attention biases start at zero, which would hide a head's share of them
        for name, parameter in model.named_parameters():
            if name.endswith(("r_w_bias", "r_r_bias", "r_kernel", "r_s_bias", "seg_embed")):
                parameter.normal_()
    return model


@pytest.mark.parametrize("cls_name", ["FunnelForMaskedLM", "FunnelForSequenceClassification"])
def test_funnel_heads_with_relative_token_type_attention_are_exact(cls_name: str) -> None:
    """Funnel Transformer's relative attention picks each head's token-type bias by a mask read by every head:
    its first layer's heads are an exact group (removal = zeroed ``post_proj`` columns = zeroed tap)."""
    model = tiny_funnel(cls_name)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 64, (2, 8), generator=generator)
    call = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
            "token_type_ids": torch.randint(0, 2, (2, 8), generator=generator)}
    assert_head_1_removal_equals_masking(model, call, projection="funnel.encoder.blocks.0.0.attention.post_proj.weight",
                                         logits=lambda out: out.logits)
