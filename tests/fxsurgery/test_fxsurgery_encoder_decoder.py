"""Heads of an encoder-decoder: a position bias a factory fills with zeros (``torch.zeros((1, heads, q, k))``, where a
layer has none of its own) follows the heads it is added to, its size a count constant; a bias made once and reused
by every layer (T5's relative-position bias in its first block, or those zeros) ties one head index across the
layers into one group. Removal equals zeroing the head's output-projection columns and equals zeroing it at its
tap; a clone leaves the outputs unchanged; greedy decoding with the cache equals decoding without it."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fxsurgery import Surgeon

HEADS, HEAD_DIM, DIM = 3, 4, 8


class ZeroBiasAttention(nn.Module):
    """Attention whose score bias, when none is handed in, is a factory's zeros of (1, heads, q, k)."""

    def __init__(self) -> None:
        super().__init__()
        self.heads = HEADS
        self.qkv, self.out = nn.Linear(DIM, 3 * HEADS * HEAD_DIM), nn.Linear(HEADS * HEAD_DIM, DIM)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, HEAD_DIM).permute(2, 0, 3, 1, 4)
        if bias is None:
            bias = torch.zeros((1, self.heads, n, n), dtype=x.dtype)
        causal = torch.ones(n, n, dtype=x.dtype).tril().log()  # a fill broadcast over the heads: ties none
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias + causal)
        return self.out(y.transpose(1, 2).reshape(b, n, -1)), bias


class Stack(nn.Module):
    """Two layers; the second reuses the first's bias, as T5's layers do."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Linear(3, DIM), nn.Linear(DIM, 2)
        self.layers = nn.ModuleList([ZeroBiasAttention() for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, bias = self.embed(x), None
        for layer in self.layers:
            y, bias = layer(h, bias)
            h = h + y
        return self.head(h)


def test_a_zero_bias_made_by_a_factory_follows_the_heads_it_is_added_to() -> None:
    torch.manual_seed(0)
    model, x = Stack().double().eval(), torch.randn(2, 5, 3, dtype=torch.float64)
    reference, zeroed = model(x).detach(), copy.deepcopy(model)
    s = Surgeon(model, (x,))
    (heads,) = [g for g in s.groups if g.kind == "head"]  # one head index over both layers, which share the bias
    assert (heads.count, heads.exact) == (HEADS, True)
    assert sorted({sl.name for sl in heads.slices if sl.name.endswith("out.weight")}) == \
        ["layers.0.out.weight", "layers.1.out.weight"]
    handle = s.tap(heads, lambda a: a.select(-2, 1).zero_())
    tapped = model(x).detach()
    handle.remove()
    with torch.no_grad():
        for layer in zeroed.layers:
            layer.out.weight[:, HEAD_DIM:2 * HEAD_DIM] = 0
    s.remove(heads, 1)
    assert model.layers[0].out.weight.shape == (DIM, (HEADS - 1) * HEAD_DIM)
    removed = model(x).detach()
    assert torch.allclose(removed, zeroed(x), atol=1e-12) and torch.allclose(removed, tapped, atol=1e-12)
    assert not torch.allclose(removed, reference, atol=1e-6)
    s.clone(heads, 0)
    assert torch.allclose(model(x), removed, atol=1e-12)


def tiny_t5() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                                   num_heads=4, decoder_start_token_id=0, dropout_rate=0.0)
    return transformers.T5ForConditionalGeneration(config).double().eval()


T5_HEADS = {  # group -> the attention modules its heads are in
    "encoder.block:head": [f"encoder.block.{i}.layer.0.SelfAttention" for i in range(2)],
    "decoder.block:head": [f"decoder.block.{i}.layer.0.SelfAttention" for i in range(2)],
    "decoder.block:head1": [f"decoder.block.{i}.layer.1.EncDecAttention" for i in range(2)],
}


@pytest.mark.parametrize("group", list(T5_HEADS))
def test_t5_self_and_cross_attention_heads_are_exact(group: str) -> None:
    """Encoder self-attention, decoder self-attention and cross-attention: a group each, one head index over the
    stack's layers; removal equals both oracles, a clone keeps the logits, and cached decoding equals uncached."""
    model = tiny_t5()
    zeroed = copy.deepcopy(model)
    ids = torch.randint(0, 64, (2, 8))

    def logits(m: nn.Module) -> torch.Tensor:
        with torch.no_grad():
            return m(input_ids=ids, labels=ids).logits

    reference = logits(model)
    s = Surgeon(model, (), {"input_ids": ids, "labels": ids})
    assert sorted(g.name for g in s.groups if g.kind == "head") == sorted(T5_HEADS)
    heads = s.group(group)
    assert (heads.count, heads.exact) == (4, True)
    projections = sorted({sl.name for sl in heads.slices if sl.name.endswith(".o.weight")})
    assert projections == [f"{module}.o.weight" for module in T5_HEADS[group]]
    handle = s.tap(heads, lambda a: a.select(-2, 1).zero_())
    tapped = logits(model)
    handle.remove()
    with torch.no_grad():
        for name in projections:
            zeroed.get_parameter(name)[:, 8:16] = 0
    s.remove(heads, 1)
    removed = logits(model)
    assert torch.allclose(removed, logits(zeroed), atol=1e-10) and torch.allclose(removed, tapped, atol=1e-10)
    options = dict(max_new_tokens=4, do_sample=False)
    with torch.no_grad():
        cached = model.generate(ids, use_cache=True, **options)
        assert torch.equal(cached, model.generate(ids, use_cache=False, **options))
        assert torch.equal(cached, zeroed.generate(ids, use_cache=True, **options))
    assert not torch.allclose(removed, reference, atol=1e-6)
    s.clone(heads, 2)
    assert torch.allclose(logits(model), removed, atol=1e-10)


class FoldedAttention(nn.Module):
    """Heads folded into the batch, the score bias added by ``baddbmm`` (as Bloom does): a learned per-head bias,
    or ALiBi's slopes computed from the head count."""

    def __init__(self, learned: bool) -> None:
        super().__init__()
        self.heads, self.learned = HEADS, learned
        self.qkv, self.out = nn.Linear(DIM, 3 * HEADS * HEAD_DIM), nn.Linear(HEADS * HEAD_DIM, DIM)
        self.bias = nn.Parameter(torch.randn(1, HEADS, 1, 5)) if learned else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        qkv = self.qkv(x).view(b, n, 3, self.heads, HEAD_DIM).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.reshape(3, b * self.heads, n, HEAD_DIM)
        if self.learned:
            bias = self.bias.expand(b, -1, -1, -1).reshape(b * self.heads, 1, n)
        else:
            slopes = 2.0 ** (-8.0 * torch.arange(1, self.heads + 1, dtype=x.dtype) / self.heads)
            bias = (slopes[:, None] * torch.arange(n, dtype=x.dtype)).expand(b, -1, -1).reshape(b * self.heads, 1, n)
        scores = torch.baddbmm(bias, q, k.transpose(1, 2), beta=1.0, alpha=HEAD_DIM ** -0.5).softmax(-1)
        y = torch.bmm(scores, v).view(b, self.heads, n, HEAD_DIM).transpose(1, 2).reshape(b, n, -1)
        return self.out(y)


class FoldedBlock(nn.Module):
    def __init__(self, learned: bool) -> None:
        super().__init__()
        self.embed, self.attn, self.head = nn.Linear(3, DIM), FoldedAttention(learned), nn.Linear(DIM, 2)
        self.fc1, self.fc2 = nn.Linear(DIM, 16), nn.Linear(16, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        h = h + self.attn(h)
        return self.head(h + self.fc2(self.fc1(h).relu()))


def test_a_learned_bias_added_by_baddbmm_keeps_its_heads_and_alibi_slopes_are_refused() -> None:
    """A per-head parameter added to the scores by ``baddbmm`` is sliced with its head (removal equals both
    oracles); slopes the code computes from the head count cannot be, and the attention is left out saying so (at
    the ``expand`` that broadcasts them over the batch)."""
    torch.manual_seed(0)
    model, x = FoldedBlock(learned=True).double().eval(), torch.randn(2, 5, 3, dtype=torch.float64)
    zeroed = copy.deepcopy(model)
    s = Surgeon(model, (x,))
    heads = s.group("attn:head")
    assert (heads.count, heads.exact) == (HEADS, True)
    handle = s.tap(heads, lambda a: a.select(-2, 1).zero_())
    tapped = model(x).detach()
    handle.remove()
    with torch.no_grad():
        zeroed.attn.out.weight[:, HEAD_DIM:2 * HEAD_DIM] = 0
    s.remove(heads, 1)
    assert model.attn.bias.shape == (1, HEADS - 1, 1, 5)
    removed = model(x).detach()
    assert torch.allclose(removed, zeroed(x), atol=1e-12) and torch.allclose(removed, tapped, atol=1e-12)

    computed = Surgeon(FoldedBlock(learned=False).double().eval(), (x,))
    assert not [g for g in computed.groups if g.kind == "head"]
    (reason,) = [r for lo in computed.left_out if lo.module == "attn" for r in lo.reasons]
    # the slopes vary along the heads where the code broadcasts them over the batch: refused at that expand
    assert reason.startswith("expand: a tensor the code computes (no parameter or buffer), which no edit can slice")


def test_bloom_alibi_heads_read_their_slopes_through_a_gather() -> None:
    """Bloom adds ALiBi slopes its model computes once from the head count to every layer's scores: each layer reads
    its kept heads' slopes through an index buffer of its own, a member of its head group, and its MLP is a group
    (tests/fxsurgery/test_fxsurgery_alibi.py checks the edits)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.BloomForCausalLM(transformers.BloomConfig(vocab_size=64, hidden_size=32, n_layer=2,
                                                                   n_head=4)).eval()
    ids = torch.randint(0, 64, (2, 8))
    s = Surgeon(model, (), {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids})
    assert sorted(g.name for g in s.groups) == sorted(f"transformer.h.{i}.{part}" for i in range(2)
                                                      for part in ("self_attention:head", "mlp:channel"))
    for i in range(2):
        assert f"transformer.h.{i}.self_attention.unit_index_0" in \
            {sl.name for sl in s.group(f"transformer.h.{i}.self_attention:head").slices}
