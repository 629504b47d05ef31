"""Grouped-query attention with one fused q/k/v projection whose rows are the query heads, then the key heads, then
the value heads (Phi-3's `qkv_proj`): a unit (a key/value head with its query heads) holds rows in three pieces of
one dim. Removal equals zeroing the unit's columns of the output projection and equals zeroing it at its tap; a clone
keeps the outputs; the pieces move each other, so edits compose down to no heads and back; the optimizer state
follows the rows."""
from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from fxsurgery import Surgeon, UnitGroup

HIDDEN, HEAD_DIM = 24, 4


class FusedGroupedQuery(nn.Module):
    """Query heads ``kv × group``, key/value heads ``kv``; rows of ``qkv``: [queries][keys][values]."""

    def __init__(self, kv: int, group: int):
        super().__init__()
        self.kv, self.group = kv, group
        self.qkv = nn.Linear(HIDDEN, (kv * group + 2 * kv) * HEAD_DIM)
        self.out = nn.Linear(kv * group * HEAD_DIM, HIDDEN)
        self.ffn_in, self.ffn_out = nn.Linear(HIDDEN, 32), nn.Linear(32, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        queries = self.kv * self.group * HEAD_DIM
        q, k, v = self.qkv(x).split([queries, self.kv * HEAD_DIM, self.kv * HEAD_DIM], dim=-1)
        q = q.view(b, n, -1, HEAD_DIM).transpose(1, 2)
        k = k.view(b, n, -1, HEAD_DIM).transpose(1, 2).repeat_interleave(self.group, dim=1)
        v = v.view(b, n, -1, HEAD_DIM).transpose(1, 2).repeat_interleave(self.group, dim=1)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, -1)
        x = x + self.out(a)
        return x + self.ffn_out(F.gelu(self.ffn_in(x)))


def masked_reference(model: FusedGroupedQuery, units: list[int]) -> nn.Module:
    """A copy with the output projection's columns of ``units`` (each unit's query heads) zeroed."""
    reference = copy.deepcopy(model)
    width = model.group * HEAD_DIM
    with torch.no_grad():
        for u in units:
            reference.out.weight[:, u * width:(u + 1) * width] = 0
    return reference


@settings(max_examples=8, deadline=None)
@given(kv=st.integers(2, 3), group=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_a_unit_in_three_pieces_of_the_fused_rows_is_removed_and_cloned_exactly(kv: int, group: int, seed: int):
    torch.manual_seed(seed)
    model = FusedGroupedQuery(kv, group).double()
    x = torch.randn(2, 5, HIDDEN, dtype=torch.float64)
    s = Surgeon(model, (x,))
    (heads,) = [g for g in s.groups if g.kind == "head"]
    assert (heads.count, heads.exact) == (kv, True), s.explain()
    pieces = [sl for sl in heads.slices if sl.name == "qkv.weight"]  # queries, then keys and values (one piece
    assert sum(sl.outer * kv * sl.inner for sl in pieces) == model.qkv.weight.shape[0]  # where a unit is one head)
    assert len(pieces) == (2 if kv > 1 and group > 1 else 1)
    unit = kv - 1
    with torch.no_grad():
        by_weights = masked_reference(model, [unit])(x)
    handle = s.tap(heads, lambda a: a.select(-2, unit).zero_())
    with torch.no_grad():
        by_tap = model(x)
    handle.remove()
    optimizer = torch.optim.Adam(model.parameters())
    model(x).square().sum().backward()
    optimizer.step()
    s.attach_optimizer(optimizer)
    kept_rows = model.qkv.weight.detach().clone()
    with torch.no_grad():  # the weights moved: the references are taken again at the stepped weights
        by_weights = masked_reference(model, [unit])(x)
    s.remove(heads, unit)
    assert heads.count == kv - 1
    with torch.no_grad():
        removed = model(x)
    assert (removed - by_weights).abs().max() < 1e-10
    rows = model.qkv.weight.shape[0]
    assert rows == (kv - 1) * (group + 2) * HEAD_DIM
    state = optimizer.state[model.qkv.weight]["exp_avg"]
    assert state.shape == model.qkv.weight.shape
    queries = (kv - 1) * group * HEAD_DIM
    assert torch.equal(model.qkv.weight[:queries], kept_rows[:queries])  # the units before the removed one
    assert torch.equal(model.qkv.weight[queries:queries + (kv - 1) * HEAD_DIM],
                       kept_rows[kv * group * HEAD_DIM:kv * group * HEAD_DIM + (kv - 1) * HEAD_DIM])
    if kv > 1:
        s.clone(heads, 0, noise_std=0.1)
        with torch.no_grad():
            assert (model(x) - removed).abs().max() < 1e-10
    del by_tap


def analysed(model_class: type[nn.Module]) -> tuple[nn.Module, torch.Tensor, Surgeon, UnitGroup]:
    """``model_class(3, 2)`` in double precision (three key/value heads of two query heads each), an input, its
    Surgeon and its head group."""
    torch.manual_seed(0)
    model = model_class(3, 2).double()
    x = torch.randn(2, 5, HIDDEN, dtype=torch.float64)
    s = Surgeon(model, (x,))
    (heads,) = [g for g in s.groups if g.kind == "head"]
    return model, x, s, heads


def test_the_tap_equals_zeroing_the_columns_and_edits_reach_no_heads_and_back() -> None:
    model, x, s, heads = analysed(FusedGroupedQuery)
    with torch.no_grad():
        by_weights = masked_reference(model, [1])(x)
    handle = s.tap(heads, lambda a: a.select(-2, 1).zero_())
    with torch.no_grad():
        assert (model(x) - by_weights).abs().max() < 1e-10
    handle.remove()
    with torch.no_grad():
        no_attention = masked_reference(model, [0, 1, 2])(x)
    for _ in range(3):
        s.remove(heads, 0)
    assert heads.count == 0 and model.qkv.weight.shape[0] == 0
    with torch.no_grad():
        assert (model(x) - no_attention).abs().max() < 1e-10


class Seen:
    """An object passed to a call, which no graph can take: the host's own forward serves the call."""

    def __init__(self) -> None:
        self.heads: list[int] = []


class GroupedByView(FusedGroupedQuery):
    """The query heads viewed per key/value head, ``view(b, n, kv, -1, head_dim)``: code that cannot run with no
    key/value heads (the -1 is ambiguous at zero elements). ``seen`` records the query heads of each call."""

    def forward(self, x: torch.Tensor, seen: Seen | None = None) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = self.qkv(x).split([self.kv * self.group * HEAD_DIM, self.kv * HEAD_DIM, self.kv * HEAD_DIM], dim=-1)
        q = q.view(b, n, self.kv, -1, HEAD_DIM).flatten(2, 3).transpose(1, 2)
        k, v = (t.view(b, n, -1, HEAD_DIM).transpose(1, 2).repeat_interleave(self.group, dim=1) for t in (k, v))
        if seen is not None:
            seen.heads.append(q.shape[1])
        x = x + self.out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, -1))
        return x + self.ffn_out(F.gelu(self.ffn_in(x)))


@pytest.mark.parametrize("removed", [[1], [0, 1, 2]])
def test_the_own_forward_of_a_host_left_with_no_units_holds_one_zero_unit_in_every_piece(removed: list[int]) -> None:
    """A call the graphs cannot take is served by the host's own forward; with every unit removed, for the call the
    group holds one zero unit, whose key and value rows lie after its query rows (the pieces of one dim placed by
    the counts, not where they lay at the analysed widths): the outputs equal the masked model's."""
    model, x, s, heads = analysed(GroupedByView)
    with torch.no_grad():
        reference = masked_reference(model, removed)(x)
    for unit in sorted(removed, reverse=True):
        s.remove(heads, unit)
    seen = Seen()
    with torch.no_grad():
        assert (model(x, seen) - reference).abs().max() < 1e-10
    assert seen.heads == [max(3 - len(removed), 1) * 2]


transformers = pytest.importorskip("transformers")


def test_phi3_heads_in_its_fused_qkv_projection() -> None:
    """Phi-3 tiny, 4 query heads over 2 key/value heads: each layer's heads are a group, removal equals masking."""
    from tests.fxsurgery.test_fxsurgery_families_more import HEAD_DIM as HF_HEAD_DIM
    from tests.fxsurgery.test_fxsurgery_families_more import assert_head_1_removal_equals_masking

    model = tiny_phi3(use_cache=False)
    projection = "model.layers.0.self_attn.o_proj.weight"

    def zero_head_1(copied: nn.Module) -> None:
        copied.get_parameter(projection)[:, 2 * HF_HEAD_DIM:] = 0  # query heads 2 and 3 read key/value head 1

    def heads(s: Surgeon):
        found = sorted((g.name, g.count, g.exact) for g in s.groups if g.kind == "head")
        assert found == [(f"model.layers.{i}.self_attn:head", 2, True) for i in range(2)], s.explain()
        return s.group("model.layers.0.self_attn:head")

    assert_head_1_removal_equals_masking(model, heads, zero_head_1)


def tiny_phi3(**options) -> nn.Module:
    """Phi-3 of 2 layers, 4 query heads over 2 key/value heads, in double precision (``options``: more config)."""
    from tests.fxsurgery.test_fxsurgery_families_more import HEADS, VOCAB
    from tests.fxsurgery.test_fxsurgery_families_more import HIDDEN as HF_HIDDEN

    torch.manual_seed(0)
    config = transformers.Phi3Config(vocab_size=VOCAB, hidden_size=HF_HIDDEN, intermediate_size=48, num_hidden_layers=2,
                                     num_attention_heads=HEADS, num_key_value_heads=2, max_position_embeddings=32,
                                     pad_token_id=0, bos_token_id=1, eos_token_id=2, **options)
    return transformers.Phi3ForCausalLM(config).double().eval()


@pytest.mark.parametrize("emptied", [[1], [0, 1]])
def test_phi3_cached_calls_are_served_by_its_own_forward_with_the_configs_head_count_in_step(emptied: list[int]):
    """Phi-3's attention reads its query rows' end off the config it shares with every layer and the model: the
    own forward sets the config's count from the layer's own heads for its call and puts it back after. Cached
    calls and ``generate`` with the cache, after removals (a layer down to no heads) and a clone, in the model, a
    copy and a pickled one, equal the model with the removed heads' ``o_proj`` columns zeroed and ``generate``
    without the cache."""
    from tests.fxsurgery.test_fxsurgery_families_more import HEAD_DIM as HF_HEAD_DIM
    from tests.fxsurgery.test_fxsurgery_families_more import VOCAB

    model = tiny_phi3()
    masked = copy.deepcopy(model)
    ids = torch.randint(3, VOCAB, (2, 5), generator=torch.Generator().manual_seed(0))
    s = Surgeon(model, (), {"input_ids": ids})
    first, second = (s.group(f"model.layers.{i}.self_attn:head") for i in range(2))
    with torch.no_grad():
        masked.model.layers[0].self_attn.o_proj.weight[:, 2 * HF_HEAD_DIM:] = 0  # key/value head 1's query heads
        for unit in emptied:
            masked.model.layers[1].self_attn.o_proj.weight[:, 2 * unit * HF_HEAD_DIM:2 * (unit + 1) * HF_HEAD_DIM] = 0
    s.remove(first, 1)
    for unit in sorted(emptied, reverse=True):
        s.remove(second, unit)
    s.clone(first, 0, noise_std=0.1)
    assert (first.count, second.count) == (2, 2 - len(emptied))
    more = torch.randint(3, VOCAB, (2, 2), generator=torch.Generator().manual_seed(1))
    for served in (model, copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        cached = assert_decodes_as_masked(served, masked, ids, more)
        with torch.no_grad():
            assert (cached.logits - masked(ids, use_cache=True).logits).abs().max() < 1e-10
        assert served.config.num_attention_heads == 4  # the shared config holds its own value between calls
    assert "own forward" in s.explain()


def test_phi3_first_layer_emptied_decodes_from_its_cache_at_the_right_position():
    """A cache reads its length off the first layer's keys, and takes an empty tensor for no entries: a first
    layer left with no heads (an own forward that runs with none) holds one zero key/value head in the cache for
    the call, so the next token from the returned cache sits at its position, and ``generate`` with the cache
    equals it without, and equals the model with that layer's ``o_proj`` columns zeroed."""
    from tests.fxsurgery.test_fxsurgery_families_more import VOCAB

    model = tiny_phi3()
    masked = copy.deepcopy(model)
    ids = torch.randint(3, VOCAB, (2, 5), generator=torch.Generator().manual_seed(0))
    s = Surgeon(model, (), {"input_ids": ids, "use_cache": True})
    first = s.group("model.layers.0.self_attn:head")
    assert first.min_count == 0
    with torch.no_grad():
        masked.model.layers[0].self_attn.o_proj.weight.zero_()
    s.keep(first, [])
    more = torch.randint(3, VOCAB, (2, 1), generator=torch.Generator().manual_seed(1))
    cached = assert_decodes_as_masked(model, masked, ids, more)
    assert cached.past_key_values.get_seq_length() == ids.shape[1] + more.shape[1]  # the prompt, then the step


def assert_decodes_as_masked(served: nn.Module, masked: nn.Module, ids: torch.Tensor, more: torch.Tensor):
    """``more`` decoded from ``served``'s cache of ``ids`` equals it decoded by ``masked``, and ``generate`` with the
    cache equals it without and equals ``masked``'s; returns ``served``'s cached call of ``ids``."""
    options = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        cached, reference = served(ids, use_cache=True), masked(ids, use_cache=True)
        step = served(more, past_key_values=cached.past_key_values, use_cache=True).logits
        assert (step - masked(more, past_key_values=reference.past_key_values, use_cache=True).logits).abs().max() \
            < 1e-10
        generated = served.generate(ids, use_cache=True, **options)
        assert torch.equal(generated, served.generate(ids, use_cache=False, **options))
        assert torch.equal(generated, masked.generate(ids, use_cache=True, **options))
    return cached


class RepeatedKeyValue(nn.Module):
    """Multi-query attention whose one key/value head is copied to every query head by ``repeat_interleave`` (a copy,
    not a broadcast view); its generator of two views cannot be traced symbolically, so torch.export captures it."""

    def __init__(self, heads: int):
        super().__init__()
        self.q, self.kv = nn.Linear(HIDDEN, heads * HEAD_DIM), nn.Linear(HIDDEN, 2 * HEAD_DIM)
        self.out = nn.Linear(heads * HEAD_DIM, HIDDEN)
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q = self.q(x).view(b, n, -1, HEAD_DIM).transpose(1, 2)
        k, v = (t.view(b, n, 1, HEAD_DIM).transpose(1, 2).repeat_interleave(self.heads, dim=1)
                for t in self.kv(x).chunk(2, dim=-1))
        return self.attend(x, q, k, v)

    def attend(self, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, _, n, _ = q.shape
        return x + self.out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, -1))

    def key_value(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The query heads and the one key and value head, ``[batch, head, token, dim]``, as a symbolic trace reads
        them."""
        b, n, _ = x.shape
        kv = self.kv(x).view(b, n, 2, 1, HEAD_DIM).transpose(1, 3)
        return self.q(x).view(b, n, -1, HEAD_DIM).transpose(1, 2), kv[:, :, :, 0], kv[:, :, :, 1]


class RepeatedByInterleave(RepeatedKeyValue):
    """The same copies, traced symbolically: the method and the function form of ``repeat_interleave``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.key_value(x)
        return self.attend(x, q, k.repeat_interleave(self.heads, dim=1), torch.repeat_interleave(v, self.heads, 1))


class RepeatedByRepeat(RepeatedKeyValue):
    """The same copies by ``repeat`` (its sizes as arguments and as one tuple), traced symbolically."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.key_value(x)
        return self.attend(x, q, k.repeat(1, self.heads, 1, 1), v.repeat((1, self.heads, 1, 1)))


@pytest.mark.parametrize("form", [RepeatedKeyValue, RepeatedByInterleave, RepeatedByRepeat])
def test_a_key_value_head_copied_to_every_query_head_follows_the_count_of_heads(form: type) -> None:
    """The copy's size is the number of query heads, set at the repeat: following it back stops there (a copy's
    strides tell nothing of its input's dims; the batch dim has the same stride and size, which once misled it), and
    the count is rewritten there: removal equals zeroing the head's columns and zeroing it at its tap, a clone keeps
    the outputs, down to no heads."""
    torch.manual_seed(0)
    model = form(heads=3).double()
    x = torch.randn(3, 5, HIDDEN, dtype=torch.float64)  # a batch as large as the head count
    s = Surgeon(model, (x,))
    (heads,) = [g for g in s.groups if g.kind == "head"]
    assert (heads.count, heads.exact) == (3, True), s.explain()
    assert ("torch.export" in s.explain()) == (form is RepeatedKeyValue)
    with torch.no_grad():
        by_weights = copy.deepcopy(model)
        by_weights.out.weight[:, HEAD_DIM:2 * HEAD_DIM] = 0
        reference = by_weights(x)
        by_weights.out.weight.zero_()
        no_heads = by_weights(x)
        handle = s.tap(heads, lambda a: a.select(-2, 1).zero_())
        assert (model(x) - reference).abs().max() < 1e-10
        handle.remove()
    s.remove(heads, 1)
    with torch.no_grad():
        removed = model(x)
        assert (removed - reference).abs().max() < 1e-10
    s.clone(heads, 0, noise_std=0.1)
    assert heads.count == 3
    with torch.no_grad():
        assert (model(x) - removed).abs().max() < 1e-10
    for _ in range(3):
        s.remove(heads, 0)
    assert heads.count == 0
    with torch.no_grad():
        assert (model(x) - no_heads).abs().max() < 1e-10
