"""The concrete-shape front end on models symbolic tracing cannot read: Hugging Face transformers, einops
models (vit-pytorch) and open_clip. Each model's table names its output projections and the width of a unit
along their input dim, so the masked reference is built from the model's own layout, not from fxsurgery's."""
from __future__ import annotations

import copy
import functools
from typing import NamedTuple

import pytest
import torch
from factories import hugging_face
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from projections import Projection, layer_groups, layers

from fxsurgery import Surgeon, TraceError
from fxsurgery.capture.front_ends import FrontEnd

pytest.importorskip("transformers")
pytest.importorskip("vit_pytorch")
pytest.importorskip("open_clip")

HIDDEN = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=24)


class Case(NamedTuple):
    build: callable
    inputs: callable  # batch, length -> example input
    heads: list[Projection]  # one per attention layer, in layer order
    channels: list[Projection]  # one per FFN
    captured: bool = True  # symbolic tracing cannot read it: the concrete-shape capture serves


def _images(batch: int, length: int) -> torch.Tensor:
    return torch.randn(batch, 3, 16, 16)


def _tokens(batch: int, length: int) -> torch.Tensor:
    return torch.randint(0, 50, (batch, length))


CASES = {
    "hf_vit_sdpa": Case(
        functools.partial(hugging_face, "ViTForImageClassification", "ViTConfig",
                          image_size=16, patch_size=8, num_labels=3,
                          **HIDDEN),
        _images, layers("vit.layers.{}.attention.o_proj.weight", 1, 8), layers("vit.layers.{}.mlp.fc2.weight", 1, 1)),
    "hf_vit_eager": Case(
        functools.partial(hugging_face, "ViTForImageClassification", "ViTConfig",
                          image_size=16, patch_size=8, num_labels=3,
                          attn_implementation="eager", **HIDDEN),
        _images, layers("vit.layers.{}.attention.o_proj.weight", 1, 8), layers("vit.layers.{}.mlp.fc2.weight", 1, 1)),
    "hf_bert": Case(
        functools.partial(hugging_face, "BertModel", "BertConfig", vocab_size=50, **HIDDEN),
        _tokens, layers("encoder.layer.{}.attention.output.dense.weight", 1, 8),
        layers("encoder.layer.{}.output.dense.weight", 1, 1)),
    "hf_gpt2": Case(  # Conv1D: weights stored [in, out]
        functools.partial(hugging_face, "GPT2Model", "GPT2Config",
                          vocab_size=50, n_embd=32, n_layer=2, n_head=4, n_inner=24,
                          n_positions=16, use_cache=False, bos_token_id=0, eos_token_id=0),
        _tokens, layers("h.{}.attn.c_proj.weight", 0, 8), layers("h.{}.mlp.c_proj.weight", 0, 1)),
    "hf_llama_gqa": Case(  # RoPE, RMSNorm, gated MLP, 2 query heads per key/value head
        functools.partial(hugging_face, "LlamaModel", "LlamaConfig", vocab_size=50, num_key_value_heads=2,
                          max_position_embeddings=32, use_cache=False, **HIDDEN),
        _tokens, layers("layers.{}.self_attn.o_proj.weight", 1, 16), layers("layers.{}.mlp.down_proj.weight", 1, 1)),
    "hf_llama_gqa_eager": Case(  # key/value heads repeated by expand + reshape
        functools.partial(hugging_face, "LlamaModel", "LlamaConfig", vocab_size=50, num_key_value_heads=2,
                          max_position_embeddings=32, use_cache=False, attn_implementation="eager", **HIDDEN),
        _tokens, layers("layers.{}.self_attn.o_proj.weight", 1, 16), layers("layers.{}.mlp.down_proj.weight", 1, 1)),
    "vit_pytorch_vit": Case(  # einops rearrange, h=self.heads
        lambda: __import__("vit_pytorch").ViT(image_size=16, patch_size=8, num_classes=3, dim=32, depth=2, heads=4,
                                              mlp_dim=24, dim_head=8),
        _images, layers("transformer.layers.{}.0.to_out.0.weight", 1, 8),
        layers("transformer.layers.{}.1.net.4.weight", 1, 1)),
    "open_clip_vit": Case(
        lambda: __import__("open_clip.transformer", fromlist=["VisionTransformer"]).VisionTransformer(
            image_size=16, patch_size=8, width=32, layers=2, heads=4, mlp_ratio=0.75, output_dim=8),
        _images, layers("transformer.resblocks.{}.attn.out_proj.weight", 1, 8),
        layers("transformer.resblocks.{}.mlp.c_proj.weight", 1, 1), captured=False),
}


@functools.cache
def _built(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return CASES[name].build().double().eval()


def _outputs(y: object) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(y) if torch.is_tensor(t) and t.is_floating_point()]


def _rel_diff(a: object, b: object) -> float:
    a, b = _outputs(a), _outputs(b)
    assert [t.shape for t in a] == [t.shape for t in b]
    scale = max([1.0] + [float(t.abs().max()) for t in b])
    return max(float((x - y).abs().max()) for x, y in zip(a, b)) / scale


def _operated(name: str) -> tuple[torch.nn.Module, torch.nn.Module, Surgeon, torch.Tensor]:
    original = _built(name)
    model = copy.deepcopy(original)
    x = CASES[name].inputs(2, 6)
    x = x.double() if x.is_floating_point() else x
    return original, model, Surgeon(model, (x,)), x


@pytest.mark.parametrize("name", list(CASES))
def test_one_exact_group_per_layer_and_shape_generic(name: str) -> None:
    original, model, s, x = _operated(name)
    pairs = layer_groups(s, CASES[name].heads, CASES[name].channels)
    assert len(s.groups) == len(pairs) and all(g.exact for g in s.groups)
    assert ("torch.export" in s.explain()) == CASES[name].captured  # explain() names the front end
    used = {use.front_end for use in s.analysis.front_ends.values()}  # the analysis records it as a FrontEnd
    assert (FrontEnd.CONCRETE in used) == CASES[name].captured and used <= set(FrontEnd)
    assert all(f"{use}" in s.explain() for use in s.analysis.front_ends.values())
    with torch.no_grad():  # the graphs serve other batch sizes and sequence lengths
        other = CASES[name].inputs(3, 9)
        other = other.double() if other.is_floating_point() else other
        assert _rel_diff(model(other), original(other)) <= 1e-12


@pytest.mark.parametrize("name", list(CASES))
@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_removals_equal_masking_and_clones_preserve(name: str, data: st.DataObject) -> None:
    original, model, s, x = _operated(name)
    masked = copy.deepcopy(original)
    weights = dict(masked.named_parameters())
    alive = {g.name: list(range(g.count)) for g in s.groups}
    for g, p in data.draw(st.permutations(layer_groups(s, CASES[name].heads, CASES[name].channels)))[:3]:
        keep_one = g.kind == "channel"
        if len(alive[g.name]) <= keep_one:
            continue
        j = data.draw(st.integers(0, len(alive[g.name]) - 1), label=f"remove from {g.name}")
        s.remove(g, j)
        unit = alive[g.name].pop(j)
        weights[p.weight].data.narrow(p.dim, unit * p.width, p.width).zero_()  # the unit's own columns
        with torch.no_grad():
            assert _rel_diff(model(x), masked(x)) <= 1e-9
    with torch.no_grad():
        before = model(x)
        gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
        for g in s.groups:
            if g.count:
                s.clone(g, data.draw(st.integers(0, g.count - 1)), noise_std=0.3, generator=gen, relative=True)
        assert _rel_diff(model(x), before) <= 1e-9


@pytest.mark.parametrize("name", ["hf_vit_sdpa", "hf_gpt2", "hf_llama_gqa", "vit_pytorch_vit"])
def test_adam_state_follows_edits_and_zero_heads_train(name: str) -> None:
    torch.manual_seed(0)
    model = copy.deepcopy(_built(name)).float().train()
    x = CASES[name].inputs(2, 6)
    s = Surgeon(model, (x,))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    s.attach_optimizer(opt)

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = _outputs(model(x))[0].square().mean()
        loss.backward()
        opt.step()
        return loss

    step()
    (head, _), *_ = layer_groups(s, CASES[name].heads, CASES[name].channels)
    channel = next(g for g, _ in layer_groups(s, CASES[name].heads, CASES[name].channels) if g.kind == "channel")
    out = next(sl for sl in channel.slices if sl.output)
    param = dict(model.named_parameters())[out.name]
    before = opt.state[param]["exp_avg"].clone()
    s.remove(channel, 0)
    kept = before.narrow(out.dim, 1, before.shape[out.dim] - 1)
    assert torch.equal(opt.state[param]["exp_avg"], kept)  # retained moments bit-identical
    s.clone(channel, 0)
    while head.count:
        s.remove(head, 0)
    for p in model.parameters():
        assert opt.state[p]["exp_avg"].shape == p.shape
    assert torch.isfinite(step())  # a layer with zero heads trains


@pytest.mark.parametrize("name", ["hf_vit_sdpa", "hf_bert", "vit_pytorch_vit"])
def test_train_and_eval_behave_like_the_original(name: str) -> None:
    original = copy.deepcopy(_built(name))
    model = copy.deepcopy(original)
    x = CASES[name].inputs(2, 6)
    x = x.double() if x.is_floating_point() else x
    Surgeon(model, (x,))
    with torch.no_grad():
        for mode in (True, False):
            model.train(mode)
            original.train(mode)
            torch.manual_seed(3)
            a = model(x)
            torch.manual_seed(3)
            b = original(x)
            assert _rel_diff(a, b) <= 1e-12


@pytest.mark.parametrize("name", ["hf_gpt2", "hf_llama_gqa", "vit_pytorch_vit"])
def test_barter_wrap_trains_with_transfers(name: str) -> None:
    import barter

    torch.manual_seed(0)
    model = copy.deepcopy(_built(name)).float().train()
    x = CASES[name].inputs(4, 6)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ctl = barter.wrap(model, opt, total_steps=30, density=0.5, example_inputs=(x,), seed=0)
    budget = {k: sum(v.get(k, 0) for v in ctl.topology().values()) for k in ("head", "channel")}
    for _ in range(30):
        opt.zero_grad()
        loss = _outputs(model(x))[0].square().mean()
        loss.backward()
        opt.step()
        assert torch.isfinite(loss)
    assert sum(e["skipped"] is None for e in ctl.events) > 0
    assert budget == {k: sum(v.get(k, 0) for v in ctl.topology().values()) for k in ("head", "channel")}


def test_neither_front_end_names_both_failures() -> None:
    class Untraceable(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if float(x.sum()) > 0:  # data-dependent control flow: neither a proxy nor a fake tensor decides it
                return self.fc(x)
            return x

    with pytest.raises(TraceError, match="cannot trace.*cannot capture"):
        Surgeon(Untraceable(), (torch.ones(2, 4),))


class EinopsAttention(torch.nn.Module):
    """Attention written with einops throughout: its head count lives in axis lengths (``h=self.heads``)."""

    def __init__(self, dim: int, heads: int, head_dim: int):
        super().__init__()
        import einops.layers.torch as layers

        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * heads * head_dim)
        self.out = torch.nn.Linear(heads * head_dim, dim)
        self.merge = layers.Rearrange("b h n d -> b n (h d)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import einops

        q, k, v = einops.rearrange(self.qkv(x), "b n (three h d) -> three b h n d", three=3, h=self.heads)
        scores = einops.einsum(q, k, "b h i d, b h j d -> b h i j") * q.shape[-1] ** -0.5
        return self.out(self.merge(scores.softmax(dim=-1) @ v))


class EinopsModel(torch.nn.Module):
    def __init__(self, heads: int = 3, head_dim: int = 4, dim: int = 8, hidden: int = 5):
        super().__init__()
        import einops.layers.torch as layers

        self.cls = torch.nn.Parameter(torch.randn(1, 1, dim))
        self.attn = EinopsAttention(dim, heads, head_dim)
        self.ffn = torch.nn.Sequential(torch.nn.Linear(dim, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, dim))
        self.pool = layers.Reduce("b n d -> b d", "mean")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import einops

        x = torch.cat([einops.repeat(self.cls, "1 1 d -> b 1 d", b=x.shape[0]), x], dim=1)
        x = x + self.attn(x)
        return self.pool(x + self.ffn(x))


@settings(max_examples=5, deadline=None)
@given(heads=st.integers(1, 4), removed=st.integers(0, 4))
def test_einops_counts_are_rewritten_down_to_zero_heads(heads: int, removed: int) -> None:
    pytest.importorskip("einops")
    torch.manual_seed(heads)
    original = EinopsModel(heads=heads).double()
    model = copy.deepcopy(original)
    s = Surgeon(model, (torch.randn(2, 5, 8, dtype=torch.double),))
    head = next(g for g in s.groups if g.kind == "head")
    assert head.count == heads and "torch.export" in s.explain()
    removed = min(removed, heads)
    for _ in range(removed):
        s.remove(head, 0)
    weights = dict(original.named_parameters())
    with torch.no_grad():
        weights["attn.out.weight"][:, : removed * 4] = 0  # heads 0 .. removed-1 masked at the output projection
        x = torch.randn(3, 7, 8, dtype=torch.double)  # another batch size and length
        assert _rel_diff(model(x), original(x)) <= 1e-9


def test_hugging_face_attention_mask_as_an_input() -> None:
    model = copy.deepcopy(_built("hf_bert"))
    original = copy.deepcopy(model)
    ids = CASES["hf_bert"].inputs(2, 6)
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, 4:] = 0  # padding in the second sequence
    s = Surgeon(model, (ids, mask))
    head = next(g for g in s.groups if g.kind == "head")
    s.remove(head, 1)
    weights = dict(original.named_parameters())
    with torch.no_grad():
        weights[f"{head.module}.output.dense.weight"][:, 8:16] = 0
        ids, mask = CASES["hf_bert"].inputs(3, 8), torch.ones(3, 8, dtype=torch.long)
        mask[0, 5:] = 0
        assert _rel_diff(model(ids, mask), original(ids, mask)) <= 1e-9


def test_a_captured_model_pickles_copies_and_is_analysed_again() -> None:
    import io

    _, model, s, x = _operated("vit_pytorch_vit")
    head = next(g for g in s.groups if g.kind == "head")
    s.remove(head, 0)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    copied = copy.deepcopy(model)
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x)) and torch.equal(copied(x), model(x))
    again = Surgeon(copied, (x,))
    assert sorted(g.count for g in again.groups if g.kind == "head") == [3, 4]
