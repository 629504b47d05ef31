"""fxsurgery on transformers built from torch's own modules: nn.TransformerEncoder(Layer),
nn.TransformerDecoderLayer and nn.MultiheadAttention (self- and cross-attention, masks, separate key/value
widths), and torchvision's VisionTransformer."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from conformance_checks import Conformance, check_surgery, check_training
from hypothesis import given
from hypothesis import strategies as st
from test_fxsurgery_properties import assert_masked_then_clones_exact, layer_groups, remove_random_unit
from zoo import masked_copy

from fxsurgery import Surgeon

WIDTH = 12


class Encoder(nn.Module):
    """Tokens (B, N, 5) -> logits, through nn.TransformerEncoder; masks pass through when given."""

    def __init__(self, heads: int, ffn: int, depth: int, norm_first: bool, batch_first: bool):
        super().__init__()
        self.batch_first = batch_first
        self.embed = nn.Linear(5, WIDTH)
        layer = nn.TransformerEncoderLayer(WIDTH, heads, ffn, dropout=0.2, batch_first=batch_first,
                                           norm_first=norm_first)
        self.encoder = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, x: torch.Tensor, padding: torch.Tensor | None = None,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embed(x) if self.batch_first else self.embed(x).transpose(0, 1)
        h = self.encoder(h, mask=mask, src_key_padding_mask=padding)
        return self.head(h.mean(1 if self.batch_first else 0))


shapes = st.fixed_dictionaries({"heads": st.sampled_from([2, 3, 4]), "ffn": st.integers(2, 6),
                                "depth": st.integers(1, 2), "norm_first": st.booleans(),
                                "batch_first": st.booleans()})


def build(kw: dict, seed: int = 0) -> tuple[Encoder, torch.Tensor]:
    torch.manual_seed(seed)
    return Encoder(**kw).double(), torch.randn(2, 6, 5, dtype=torch.double)


@given(kw=shapes, data=st.data())
def test_encoder_groups_clone_remove_and_modes(kw: dict, data: st.DataObject) -> None:
    model, x = build(kw)
    original = copy.deepcopy(model)
    s = Surgeon(model, (x,))
    groups = layer_groups(s)
    layers = [f"encoder.layers.{i}" for i in range(kw["depth"])]
    assert sorted(groups) == sorted([f"{n}.self_attn.out_proj.weight" for n in layers]
                                    + [f"{n}.linear2.weight" for n in layers])
    assert [g.name for g in s.groups if g.kind == "head"] == [f"{n}.self_attn:head" for n in layers]
    assert all(g.exact for g in s.groups)
    for mode in ("train", "eval"):  # same seed: the same dropout draws as torch's own forward
        getattr(model, mode)(), getattr(original, mode)()
        torch.manual_seed(1)
        y = model(x)
        torch.manual_seed(1)
        y_ref = original(x)
        assert torch.equal(y, y_ref) if mode == "train" else torch.allclose(y, y_ref, rtol=0, atol=1e-12)
    width = {name: (WIDTH // kw["heads"] if g.kind == "head" else 1) for name, g in groups.items()}
    alive = {name: list(range(g.count)) for name, g in groups.items()}
    for _ in range(data.draw(st.integers(1, 5))):
        remove_random_unit(s, groups, alive, data)
    for name, g in groups.items():
        if g.kind == "head":
            attn = model.get_submodule(name.rsplit(".", 2)[0])
            assert attn.num_heads == g.count and attn.in_proj_weight.shape[0] == 3 * g.count * width[name]
    assert_masked_then_clones_exact(s, original, x, groups, alive, width, data)


def test_masks_are_inputs_and_survive_edits() -> None:
    model, x = build({"heads": 3, "ffn": 4, "depth": 2, "norm_first": True, "batch_first": True})
    padding = torch.zeros(2, 6, dtype=torch.bool)
    padding[1, 4:] = True
    causal = torch.ones(6, 6, dtype=torch.bool).triu(1)  # True: masked out, as torch reads bool masks
    original = copy.deepcopy(model)
    s = Surgeon(model, (x, padding, causal))
    assert [g.kind for g in s.groups] == ["head", "channel"] * 2 and all(g.exact for g in s.groups)
    torch.manual_seed(1)
    y = model(x, padding, causal)
    torch.manual_seed(1)
    assert torch.equal(y, original(x, padding, causal))
    model.eval()
    with torch.no_grad():
        y0 = model(x, padding, causal)
        for g in s.groups:
            s.clone(g, 0, noise_std=0.1)
        assert (model(x, padding, causal) - y0).abs().max().item() <= 1e-9
        assert not torch.equal(model(x, padding), y0)  # the mask is read at run time, not baked


class CrossBlock(nn.Module):
    """Self-attention through nn.MultiheadAttention's default call (weights computed, then dropped) and
    cross-attention to a memory of another width."""

    def __init__(self, return_weights: bool = False):
        super().__init__()
        self.return_weights = return_weights
        self.self_attn = nn.MultiheadAttention(WIDTH, 4, batch_first=True)
        self.cross = nn.MultiheadAttention(WIDTH, 3, kdim=7, vdim=5, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 8), nn.GELU(), nn.Linear(8, WIDTH))

    def forward(self, x: torch.Tensor, keys: torch.Tensor,
                values: torch.Tensor) -> tuple[torch.Tensor, ...] | torch.Tensor:
        a, weights = self.self_attn(x, x, x)
        x = x + a
        x = x + self.cross(x, keys, values, need_weights=False)[0]
        x = x + self.mlp(x)
        return (x, weights) if self.return_weights else x


def test_cross_attention_and_separate_key_value_widths() -> None:
    torch.manual_seed(0)
    model = CrossBlock().double()
    x, keys, values = (torch.randn(2, 5, n, dtype=torch.double) for n in (WIDTH, 7, 5))
    original = copy.deepcopy(model)
    s = Surgeon(model, (x, keys, values))
    assert {g.name: (g.count, g.exact) for g in s.groups} == {
        "self_attn:head": (4, True), "cross:head": (3, True), "mlp:channel": (8, True)}
    assert {sl.name for sl in s.group("cross:head").slices if sl.dim == 0} == {
        "cross.q_proj_weight", "cross.k_proj_weight", "cross.v_proj_weight", "cross.in_proj_bias"}
    model.eval()
    with torch.no_grad():
        y0 = model(x, keys, values)
        assert torch.allclose(y0, original.eval()(x, keys, values), rtol=0, atol=1e-12)
        s.remove(s.group("cross:head"), 1)
        s.clone(s.group("self_attn:head"), 2, noise_std=0.1)
        masked = masked_copy(original, {"cross.out_proj.weight": {1}}, {"cross.out_proj.weight": WIDTH // 3})
        assert (model(x, keys, values) - masked(x, keys, values)).abs().max().item() <= 1e-9


def test_returned_attention_weights_make_heads_inexact() -> None:
    """Averaged over heads, the returned weights change with any head edit: the group says so."""
    torch.manual_seed(0)
    model = CrossBlock(return_weights=True).double()
    x, keys, values = (torch.randn(2, 5, n, dtype=torch.double) for n in (WIDTH, 7, 5))
    s = Surgeon(model, (x, keys, values))
    g = s.group("self_attn:head")
    assert not g.exact and any("mean" in note for note in g.notes)
    assert s.group("cross:head").exact


def test_decoder_layer_cross_attention() -> None:
    torch.manual_seed(0)
    model = nn.TransformerDecoderLayer(WIDTH, 4, 10, dropout=0.0, batch_first=True).double().eval()
    tgt, memory = torch.randn(2, 5, WIDTH, dtype=torch.double), torch.randn(2, 7, WIDTH, dtype=torch.double)
    s = Surgeon(model, (tgt, memory))
    assert {g.name: (g.count, g.exact) for g in s.groups} == {
        "self_attn:head": (4, True), "multihead_attn:head": (4, True), "TransformerDecoderLayer:channel": (10, True)}
    with torch.no_grad():
        y0 = model(tgt, memory)
        for g in s.groups:
            s.clone(g, 1, noise_std=0.1)
        assert (model(tgt, memory) - y0).abs().max().item() <= 1e-9


def test_unsupported_multihead_attention_is_reported() -> None:
    torch.manual_seed(0)
    model = CrossBlock().double()
    model.self_attn = nn.MultiheadAttention(WIDTH, 4, add_bias_kv=True, batch_first=True).double()
    x, keys, values = (torch.randn(2, 5, n, dtype=torch.double) for n in (WIDTH, 7, 5))
    s = Surgeon(model, (x, keys, values))
    reasons = {lo.module: " ".join(lo.reasons) for lo in s.left_out}
    assert "add_bias_kv" in reasons["self_attn"]
    assert sorted(g.name for g in s.groups) == ["cross:head", "mlp:channel"]


@pytest.mark.parametrize("conformance", ["surgery", "training"])
def test_torchvision_vision_transformer(conformance: str) -> None:
    from torchvision.models import VisionTransformer

    torch.manual_seed(0)
    model = VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=4, hidden_dim=32, mlp_dim=48,
                              num_classes=3)
    x = torch.randn(2, 3, 32, 32)
    result = Conformance("torchvision_vit")
    if conformance == "surgery":
        check_surgery(model, x, result)
        assert (result.heads, result.channels, result.exact) == (2, 2, 4) and not result.unaccounted
        assert result.clone_ok and result.remove_ok and result.modes_ok
    else:
        check_training(model, x, result)
        assert result.transfers > 0
