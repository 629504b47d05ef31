"""Installation is invisible to every call a model's forward accepts: keyword arguments, padded masks, flags
(``output_attentions``, ``output_hidden_states``, ``return_dict``, ``use_cache``), labels, other batch sizes and
lengths, train and eval. For each drawn call the operated model equals an untouched copy before any edit, the
original with the removed units' own columns zeroed after removals (the reference is built from each model's
layout table, not from fxsurgery's slices), and itself after noisy clones. Models at their default configs:
the causal LMs pass key/value caches, and ``generate`` runs after edits."""
from __future__ import annotations

import copy
import functools
from typing import Callable, NamedTuple

import pytest
import torch
from factories import hugging_face
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from projections import Projection, layer_groups, layers

from fxsurgery import Surgeon, UnservedCall, analyse
from fxsurgery.runtime.graph_forward import MAX_GRAPHS

transformers = pytest.importorskip("transformers")

HIDDEN = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=24)
QUIET = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


class Case(NamedTuple):
    build: Callable[[], torch.nn.Module]
    example: Callable[[], torch.Tensor]  # the positional call the model is analysed on
    call: Callable[[st.DataObject], dict]  # draws the keyword arguments of one call
    heads: list[Projection]
    channels: list[Projection]


def _flags(data: st.DataObject, *names: str) -> dict:
    """Each flag left out, or passed as True or False; and maybe an extra keyword argument the forward threads
    down to its layers (the Trainer's ``num_items_in_batch``)."""
    out = {"num_items_in_batch": torch.tensor(7)} if data.draw(st.booleans(), label="extra keyword") else {}
    for name in names:
        value = data.draw(st.sampled_from([None, True, False]), label=name)
        if value is not None:
            out[name] = value
    return out


def _text(data: st.DataObject, *, labels: str, flags: tuple[str, ...]) -> dict:
    batch, length = data.draw(st.integers(1, 3), label="batch"), data.draw(st.integers(2, 9), label="length")
    call = {"input_ids": torch.randint(0, 50, (batch, length))}
    if data.draw(st.booleans(), label="mask"):
        lengths = [data.draw(st.integers(1, length), label="unpadded") for _ in range(batch)]
        call["attention_mask"] = (torch.arange(length) < torch.tensor(lengths)[:, None]).long()
    if data.draw(st.booleans(), label="labels"):
        call["labels"] = torch.randint(0, 3, (batch,)) if labels == "class" else call["input_ids"]
    return {**call, **_flags(data, *flags)}


def _ids() -> torch.Tensor:
    return torch.randint(0, 50, (2, 6))


def _pixels() -> torch.Tensor:
    return torch.randn(2, 3, 16, 16, dtype=torch.float64)


def _images(data: st.DataObject) -> dict:
    batch = data.draw(st.integers(1, 3), label="batch")
    call = {"pixel_values": torch.randn(batch, 3, 16, 16, dtype=torch.float64)}
    if data.draw(st.booleans(), label="labels"):
        call["labels"] = torch.randint(0, 3, (batch,))
    return {**call, **_flags(data, "output_attentions", "output_hidden_states", "return_dict")}


CASES = {
    "hf_vit_eager": Case(  # eager attention returns per-head weights when asked
        functools.partial(hugging_face, "ViTForImageClassification", "ViTConfig",
                          image_size=16, patch_size=8, num_labels=3,
                          attn_implementation="eager", **HIDDEN, **QUIET),
        _pixels, _images, layers("vit.layers.{}.attention.o_proj.weight", 1, 8),
        layers("vit.layers.{}.mlp.fc2.weight", 1, 1)),
    "hf_bert_classifier": Case(
        functools.partial(hugging_face, "BertForSequenceClassification", "BertConfig", vocab_size=50, num_labels=3,
                          **HIDDEN, **QUIET),
        _ids, functools.partial(_text, labels="class",
                                flags=("output_attentions", "output_hidden_states", "return_dict")),
        layers("bert.encoder.layer.{}.attention.output.dense.weight", 1, 8),
        layers("bert.encoder.layer.{}.output.dense.weight", 1, 1)),
    "hf_gpt2_lm": Case(  # default config: use_cache=True, Conv1D weights stored [in, out]
        functools.partial(hugging_face, "GPT2LMHeadModel", "GPT2Config", vocab_size=50, n_embd=32, n_layer=2, n_head=4,
                          n_inner=24, n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
        _ids, functools.partial(_text, labels="tokens", flags=("use_cache", "output_hidden_states", "return_dict")),
        layers("transformer.h.{}.attn.c_proj.weight", 0, 8), layers("transformer.h.{}.mlp.c_proj.weight", 0, 1)),
    "hf_llama_lm": Case(  # default config: use_cache=True; 2 query heads per key/value head
        functools.partial(hugging_face, "LlamaForCausalLM", "LlamaConfig", vocab_size=50, num_key_value_heads=2,
                          max_position_embeddings=32, **HIDDEN),
        _ids, functools.partial(_text, labels="tokens", flags=("use_cache", "output_hidden_states", "return_dict")),
        layers("model.layers.{}.self_attn.o_proj.weight", 1, 16),
        layers("model.layers.{}.mlp.down_proj.weight", 1, 1)),
}


@functools.cache
def _prepared(name: str) -> tuple[torch.nn.Module, Surgeon]:
    """The untouched model and an operated copy, analysed on a plain positional call (ids or images only)."""
    torch.manual_seed(0)
    original = CASES[name].build().double().eval()
    return original, Surgeon(copy.deepcopy(original), (CASES[name].example(),))


def _compared(output: object) -> list[torch.Tensor]:
    """The outputs a masked reference must reproduce: everything but per-head attention weights and caches."""
    items = output.items() if hasattr(output, "items") else enumerate(output if isinstance(output, tuple) else [output])
    tensors = []
    for key, value in items:
        if "attentions" in str(key) or "past_key_values" in str(key) or "cache" in str(key):
            continue
        tensors += [t for t in torch.utils._pytree.tree_leaves(value) if torch.is_tensor(t) and t.is_floating_point()]
    return tensors


def _rel_diff(a: object, b: object, *, every: bool = False) -> float:
    pick = (lambda y: [t for t in torch.utils._pytree.tree_leaves(y) if torch.is_tensor(t)]) if every else _compared
    a, b = pick(a), pick(b)
    assert [t.shape for t in a] == [t.shape for t in b]
    scale = max([1.0] + [float(t.abs().max()) for t in b if t.numel()])
    return max([0.0] + [float((x - y).abs().max()) for x, y in zip(a, b) if x.numel()]) / scale


def _run(model: torch.nn.Module, call: dict, train: bool) -> object:
    model.train(train)
    with torch.no_grad():
        return model(**call)


@pytest.mark.parametrize("name", list(CASES))
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_installation_is_invisible_to_every_call(name: str, data: st.DataObject) -> None:
    original, prepared = _prepared(name)
    calls = [(CASES[name].call(data), data.draw(st.booleans(), label="train")) for _ in range(2)]
    for call, train in calls:  # before any edit: the untouched model's outputs, attention weights included
        assert _rel_diff(_run(prepared.model, call, train), _run(original, call, train), every=True) <= 1e-9
    s = copy.deepcopy(prepared)
    masked = copy.deepcopy(original)
    weights = dict(masked.named_parameters())
    alive = {g.name: list(range(g.count)) for g in s.groups}
    pairs = layer_groups(s, CASES[name].heads, CASES[name].channels)
    plan = data.draw(st.lists(st.sampled_from(range(len(pairs))), min_size=1, max_size=5), label="removals")
    if data.draw(st.booleans(), label="empty a layer"):
        plan += [0] * pairs[0][0].count  # every head of the first attention layer
    for k in plan:
        g, p = pairs[k]
        if len(alive[g.name]) <= g.min_count:
            continue
        j = data.draw(st.integers(0, len(alive[g.name]) - 1))
        s.remove(g, j)
        unit = alive[g.name].pop(j)
        weights[p.weight].data.narrow(p.dim, unit * p.width, p.width).zero_()  # the unit's own columns
    served = []
    for call, train in calls:
        if call.get("output_attentions"):  # per-head weights are compared by name, so in a dict
            call = {**call, "return_dict": True}
        # an emptied layer too: a host's own forward (serving a cache) that cannot run one holds a zero unit
        assert _rel_diff(_run(s.model, call, train), _run(masked, call, train)) <= 1e-9
        served.append((call, train))
    before = [_run(s.model, call, train) for call, train in served]
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    for g in s.groups:
        if g.count:
            s.clone(g, data.draw(st.integers(0, g.count - 1)), noise_std=0.3, generator=gen, relative=True)
    for (call, train), y in zip(served, before):
        assert _rel_diff(_run(s.model, call, train), y) <= 1e-9


def test_padded_bert_equals_the_unpadded_sequences() -> None:
    """A padded batch through an operated BERT equals each sequence run alone on its unpadded positions."""
    original, prepared = _prepared("hf_bert_classifier")
    s = copy.deepcopy(prepared)
    for g in s.groups:
        s.remove(g, 1)
    encoder = s.model.bert
    ids = torch.randint(0, 50, (3, 8))
    lengths = [8, 5, 2]
    mask = (torch.arange(8) < torch.tensor(lengths)[:, None]).long()
    with torch.no_grad():
        padded = encoder(input_ids=ids, attention_mask=mask).last_hidden_state
        for row, n in enumerate(lengths):
            alone = encoder(input_ids=ids[row:row + 1, :n]).last_hidden_state
            assert (padded[row, :n] - alone[0]).abs().max() <= 1e-9 * alone.abs().max()


@pytest.mark.parametrize("name", ["hf_gpt2_lm", "hf_llama_lm"])
def test_generate_after_removals_equals_the_masked_original(name: str) -> None:
    """Key/value caches pass through the hosts' own forwards (checked to follow the widths): greedy decoding
    of the operated model equals that of the masked original."""
    original, prepared = _prepared(name)
    s = copy.deepcopy(prepared)
    masked = copy.deepcopy(original)
    weights = dict(masked.named_parameters())
    for g, p in layer_groups(s, CASES[name].heads, CASES[name].channels):
        s.remove(g, 0)
        weights[p.weight].data.narrow(p.dim, 0, p.width).zero_()
    ids = torch.randint(0, 50, (2, 5))
    options = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        assert torch.equal(s.model.generate(ids, **options), masked.generate(ids, **options))
    assert "own forward" in s.explain()


class _PackedCountAttention(torch.nn.Module):
    """Attention that keeps its head count in a tuple (no int attribute a removal could follow) and hands its
    per-head values to an optional recorder object."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.proj = torch.nn.Linear(16, 48), torch.nn.Linear(16, 16)
        self.layout = (4, 4)

    def forward(self, x: torch.Tensor, recorder: object = None) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, *self.layout).permute(2, 0, 3, 1, 4)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        if recorder is not None:
            recorder.append(a)
        return x + self.proj(a.transpose(1, 2).reshape(b, n, -1))


class _Recorder:
    """An object argument: no graph can take it (nor what its methods do)."""

    def __init__(self) -> None:
        self.values: list[torch.Tensor] = []

    def append(self, value: torch.Tensor) -> None:
        self.values.append(value)


def test_a_call_no_front_end_serves_is_refused_naming_the_argument() -> None:
    """An object argument goes to the host's own forward; one that reads its head count from a tuple cannot
    follow a removal, so the call is refused, naming the host and the argument."""
    model = torch.nn.Sequential(_PackedCountAttention())
    s = Surgeon(model, (torch.randn(2, 5, 16),))
    s.remove(next(g for g in s.groups if g.kind == "head"), 0)
    with pytest.raises(UnservedCall, match=r"^0 \(_PackedCountAttention\) .*recorder=a _Recorder \(analysed with "
                                           r"None\).*its own forward fails once a unit is removed"):
        model[0](torch.randn(2, 5, 16), recorder=_Recorder())
    assert model[0](torch.randn(2, 5, 16)).shape == (2, 5, 16)  # the analysed call is served as before


def test_a_host_whose_own_forward_reads_an_int_count_serves_hooked_calls() -> None:
    """timm's attention reads ``num_heads``, an int attribute that is found to follow removals, so once a hook
    sits inside the host (whose call a graph inlines) its own forward serves, runs the hook, and equals the graph.
    The attribute holds the current count for the call and the value it held after it."""
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", num_classes=3, img_size=32, patch_size=8, depth=1).eval()
    s = Surgeon(model, (torch.randn(2, 3, 32, 32),))
    s.remove(next(g for g in s.groups if g.kind == "head"), 0)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        by_graph = model(x)
        seen = []
        attn = model.blocks[0].attn
        attn.proj.register_forward_hook(lambda module, args, out: seen.append((out.shape, attn.num_heads)))
        by_own_forward = model(x)
    assert seen == [((2, 17, 192), 2)] and attn.num_heads == 3
    assert torch.allclose(by_own_forward, by_graph, atol=1e-6)
    assert "1 by its own forward (hooks on proj" in s.explain()


class _MaskedRepeatAttention(torch.nn.Module):
    """Four query heads on one key/value head, which the attention broadcasts; given a mask, the forward repeats it
    to the query heads first, ``n_rep`` times (an int attribute the unmasked path reads only as a flag)."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.kv, self.proj = torch.nn.Linear(16, 16), torch.nn.Linear(16, 8), torch.nn.Linear(16, 16)
        self.n_rep = 4

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, recorder: object = None) -> torch.Tensor:
        b, n, _ = x.shape
        q = self.q(x).view(b, n, -1, 4).transpose(1, 2)
        k, v = self.kv(x).view(b, n, 2, 1, 4).permute(2, 0, 3, 1, 4)
        if mask is not None and self.n_rep > 1:
            k, v = (t.expand(b, self.n_rep, n, 4) for t in (k, v))
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        if recorder is not None:
            recorder.append(a)
        return x + self.proj(a.transpose(1, 2).reshape(b, n, -1))


def test_a_host_own_forward_is_fitted_on_the_path_of_the_call_it_serves() -> None:
    """Analysed without a mask, the host's own forward follows removals with no count attribute set; a call with
    a mask and an object (which only the own forward serves) takes the path that repeats the key/value head
    ``n_rep`` times: there ``n_rep`` is found to follow the query heads (set for the call: 4 heads' repeats would
    not fit 3 query heads), and the call equals the original with the removed head's output columns zeroed."""
    torch.manual_seed(0)
    original = torch.nn.Sequential(_MaskedRepeatAttention())
    model = copy.deepcopy(original)
    s = Surgeon(model, (torch.randn(2, 5, 16),))
    (heads,) = [g for g in s.groups if g.kind == "head"]
    assert heads.count == 4
    s.remove(heads, 1)
    with torch.no_grad():
        original[0].proj.weight[:, 4:8] = 0
        x, mask = torch.randn(2, 5, 16), torch.rand(2, 1, 5, 5) > 0.3
        mask[..., 0] = True  # every query sees a key
        recorder = _Recorder()
        got = model[0](x, mask=mask, recorder=recorder)
        assert torch.allclose(got, original[0](x, mask=mask), atol=1e-6)
        assert torch.allclose(model(x), original(x), atol=1e-6)
    assert model[0].n_rep == 4 and recorder.values[0].shape[1] == 3  # the value it held is put back after the call


def test_an_installed_forward_keeps_the_signature_frameworks_read() -> None:
    """The HF Trainer keeps only the batch columns ``model.forward``'s signature names."""
    import inspect

    original, prepared = _prepared("hf_bert_classifier")
    host = next(m for m in prepared.model.modules() if "forward" in m.__dict__)
    assert inspect.signature(host.forward) == inspect.signature(type(host).forward.__get__(host))
    assert "attention_mask" in inspect.signature(prepared.model.forward).parameters


@pytest.mark.parametrize("name, config, output_projection", [
    ("LlamaModel", lambda: transformers.LlamaConfig(vocab_size=50, **HIDDEN), "layers.0.self_attn.o_proj"),
    ("Qwen2Model", lambda: transformers.Qwen2Config(vocab_size=50, num_key_value_heads=2, **HIDDEN),
     "layers.0.self_attn.o_proj"),
    ("GPT2Model", lambda: transformers.GPT2Config(vocab_size=50, n_embd=32, n_layer=2, n_head=4, n_inner=24),
     "h.0.attn.c_proj"),
])
def test_decoders_at_their_default_configs_have_head_groups(name: str, config: Callable,
                                                            output_projection: str) -> None:
    """use_cache=True by default: the analysis reads the call without the cache object, and the cached calls
    (a forward that returns the cache, then one that reads it) equal the untouched model's. Their hosts' own
    forwards serve the cached calls, and a layer left with no heads holds one zero head there (GPT-2's splits its
    fused projection by a count it stores, which cannot be split with none): the first layer emptied, the cached
    calls equal the model with that layer's output projection zeroed."""
    cfg = config()
    assert cfg.use_cache
    torch.manual_seed(0)
    original = getattr(transformers, name)(cfg).eval()
    model = copy.deepcopy(original)
    s = Surgeon(model, (torch.randint(0, 50, (2, 6)),))
    assert [g.kind for g in s.groups] == ["head", "channel"] * 2 and all(g.exact for g in s.groups)
    heads = [g for g in s.groups if g.kind == "head"]
    assert all(g.min_count == 0 and not any("keeps one unit" in note for note in g.notes) for g in heads)
    ids, more = torch.randint(0, 50, (2, 6)), torch.randint(0, 50, (2, 1))
    with torch.no_grad():
        first, reference = model(ids), original(ids)
        assert _rel_diff(first, reference) <= 1e-5
        assert first.cache.get_seq_length() == 6
        step = model(more, cache=first.cache)
        assert first.cache.get_seq_length() == 7  # the own forward updated the cache the call passed
        assert _rel_diff(step, original(more, cache=reference.cache)) <= 1e-5
        s.keep(heads[0], [])
        original.get_submodule(output_projection).weight.zero_()
        first, reference = model(ids), original(ids)
        step = model(more, cache=first.cache)
        assert first.cache.get_seq_length() == 7
        assert _rel_diff(step, original(more, cache=reference.cache)) <= 1e-5


def test_a_size_read_off_a_tensor_is_the_same_call_as_the_tuple_an_installed_caller_passes() -> None:
    """A block called with ``pixels.shape[2:]`` (a ``torch.Size``) is analysed on it, and the installed caller's
    graph passes the same sizes as a plain tuple: one signature, so the analysed graph serves both (HF BEiT's
    layers, called with the image's resolution, had no graph for their own caller's call)."""
    from fxsurgery.runtime.call_signature import call_signature

    x = torch.randn(2, 5, 16)
    assert call_signature((x,), {"resolution": torch.Size([32, 32])}, True) == \
        call_signature((x,), {"resolution": (32, 32)}, True)
    assert call_signature((x,), {"resolution": (32, 32)}, True) != call_signature((x,), {"resolution": (32, 16)}, True)



def test_a_host_keeps_its_own_forward_fits_within_the_graphs_bound() -> None:
    """A host served with ever new call signatures (objects of a new type each time, which its own forward
    serves, each fitted once) keeps at most ``MAX_GRAPHS`` fits and graphs; a call whose fit was forgotten is
    fitted again and still equals the original with the removed head's columns zeroed."""
    torch.manual_seed(0)
    original = torch.nn.Sequential(_MaskedRepeatAttention())
    model = copy.deepcopy(original)
    s = Surgeon(model, (torch.randn(2, 5, 16),))
    s.remove(s.groups[0], 1)
    forward = model[0].forward
    x, mask = torch.randn(2, 5, 16), torch.ones(2, 1, 5, 5, dtype=torch.bool)
    recorders = [type(f"Recorder{i}", (_Recorder,), {}) for i in range(MAX_GRAPHS + 4)]
    with torch.no_grad():
        original[0].proj.weight[:, 4:8] = 0
        for recorder in recorders:
            assert torch.allclose(model[0](x, mask=mask, recorder=recorder()), original[0](x, mask=mask), atol=1e-6)
        assert len(forward.server.fits) == MAX_GRAPHS and len(forward.graphs) <= MAX_GRAPHS + 2
        assert torch.allclose(model[0](x, mask=mask, recorder=recorders[0]()), original[0](x, mask=mask), atol=1e-6)


# MobileViT's hidden states after stages 2, 3 and 4 are the widths its fusion convolutions make and the next stage's
# expansion (or the final 1x1 expansion) reads: channel groups. Each reader, by the model's own layout
# (hidden_states index, reader weight, dim 1, one column per channel).
_MOBILEVIT_HIDDEN_READERS = {
    2: Projection("mobilevit.encoder.layer.3.downsampling_layer.expand_1x1.convolution.weight", 1, 1),
    3: Projection("mobilevit.encoder.layer.4.downsampling_layer.expand_1x1.convolution.weight", 1, 1),
    4: Projection("mobilevit.conv_1x1_exp.convolution.weight", 1, 1),
}


def _mobilevit() -> torch.nn.Module:
    config = transformers.MobileViTConfig(image_size=32, patch_size=2, hidden_sizes=[16, 24, 32], num_labels=3,
                                          neck_hidden_sizes=[8, 8, 16, 16, 24, 32, 40], num_attention_heads=2)
    return transformers.MobileViTForImageClassification(config).double().eval()


def _group_reading(surgeon: Surgeon, p: Projection) -> object:
    (group,) = [g for g in surgeon.groups if any(sl.name == p.weight and sl.dim == p.dim for sl in g.slices)]
    return group


def test_hidden_states_at_channel_widths_are_served_at_the_current_widths() -> None:
    """Analysed on the plain call, MobileViT is called with ``output_hidden_states=True``: the call is captured,
    and the hidden states at a channel group's width are returned at its current width, as the compact model
    computes them. After removals they equal, at the kept channels, the original's with the removed units' reader
    columns zeroed, and the installed model's with the units zeroed at the tap points; after clones the logits are
    unchanged and each copy is its parent's channel."""
    torch.manual_seed(0)
    original = _mobilevit()
    analysis = analyse(original, (torch.randn(2, 3, 32, 32, dtype=torch.float64),))
    s, tapped = (Surgeon(copy.deepcopy(original), analysis) for _ in range(2))
    x = torch.randn(3, 3, 32, 32, dtype=torch.float64)
    with torch.no_grad():
        assert _rel_diff(s.model(x, output_hidden_states=True), original(x, output_hidden_states=True),
                         every=True) == 0
    masked = copy.deepcopy(original)
    weights = dict(masked.named_parameters())
    kept = {}
    for index, p in _MOBILEVIT_HIDDEN_READERS.items():
        group = _group_reading(s, p)
        unit = group.count // 2
        s.remove(group, unit)
        weights[p.weight].data.narrow(p.dim, unit * p.width, p.width).zero_()
        tapped.tap(_group_reading(tapped, p), lambda a, unit=unit: a.select(-2, unit).zero_())
        kept[index] = [k for k in range(group.max_count) if k != unit]
    with torch.no_grad():
        got = s.model(x, output_hidden_states=True)
        references = masked(x, output_hidden_states=True), tapped.model(x, output_hidden_states=True)
    for want in references:
        assert _rel_diff(got.logits, want.logits) <= 1e-9
        for index, (hidden, reference) in enumerate(zip(got.hidden_states, want.hidden_states)):
            assert _rel_diff(hidden, reference[:, kept[index]] if index in kept else reference) <= 1e-9, index
    parents = {index: _group_reading(s, p) for index, p in _MOBILEVIT_HIDDEN_READERS.items()}
    for group in parents.values():
        s.clone(group, 0)
    with torch.no_grad():
        cloned = s.model(x, output_hidden_states=True)
    assert _rel_diff(cloned.logits, got.logits) <= 1e-9
    for index, (hidden, before) in enumerate(zip(cloned.hidden_states, got.hidden_states)):
        after = torch.cat([before, before[:, :1]], 1) if index in parents else before
        assert _rel_diff(hidden, after) <= 1e-9, index
