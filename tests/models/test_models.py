"""The project's timm models: registration, shapes, timm interface, fx-traceability, paper configurations."""

import pytest
import torch
from torch import nn

from barter.models.cct import CCT
from barter.rebuild import timm_with_models

timm = timm_with_models()

TINY = [("cct_2_3x1_32_tiny", 32), ("vit_paper_p8_64_tiny", 64)]
ALL = TINY + [("cct_7_3x1_32", 32), ("vit_paper_p8_64", 64)]


@pytest.mark.parametrize("name,img", ALL)
def test_create_and_forward(name: str, img: int) -> None:
    model = timm.create_model(name, num_classes=7).eval()
    assert model.pretrained_cfg["input_size"] == (3, img, img)
    assert model.default_cfg["num_classes"] == model.num_classes == 7
    with torch.no_grad():
        assert model(torch.randn(2, 3, img, img)).shape == (2, 7)


@pytest.mark.parametrize("name,img", TINY)
def test_timm_interface(name: str, img: int) -> None:
    model = timm.create_model(name, num_classes=5).eval()
    x = torch.randn(2, 3, img, img)
    with torch.no_grad():
        tokens = model.forward_features(x)
        assert tokens.dim() == 3 and tokens.shape[-1] == model.num_features
        assert model.forward_head(tokens, pre_logits=True).shape == (2, model.num_features)
        assert torch.allclose(model.forward_head(tokens), model(x))
        model.reset_classifier(3)
        assert model(x).shape == (2, 3) and model.get_classifier().out_features == 3


@pytest.mark.parametrize("name,img", TINY)
def test_channels_and_size_follow_kwargs(name: str, img: int) -> None:
    model = timm.create_model(name, in_chans=1, num_classes=10).eval()
    assert model.pretrained_cfg["input_size"] == (1, img, img)
    with torch.no_grad():
        assert model(torch.randn(2, 1, img, img)).shape == (2, 10)


@pytest.mark.parametrize("name,img", TINY)
def test_fx_traceable(name: str, img: int) -> None:
    model = timm.create_model(name, num_classes=4)
    block = model.blocks[0]
    tokens = torch.randn(2, 9, model.num_features)
    for module in (block.attn, block.mlp):
        module.eval()
        graph = torch.fx.symbolic_trace(module)
        assert torch.allclose(graph(tokens), module(tokens), atol=1e-6)
    model.eval()  # fx bakes train/eval branches (dropout, drop-path) in at trace time
    graph = torch.fx.symbolic_trace(model)
    x = torch.randn(2, 3, img, img)
    assert torch.allclose(graph(x), model(x), atol=1e-5)


def test_cct_7_3x1_architecture() -> None:
    model = timm.create_model("cct_7_3x1_32", num_classes=100)
    assert isinstance(model, CCT)
    conv = model.tokenizer.conv
    assert (conv.kernel_size, conv.stride, conv.padding, conv.bias) == ((3, 3), (1, 1), (1, 1), None)
    pool = model.tokenizer.pool
    assert (pool.kernel_size, pool.stride, pool.padding) == (3, 2, 1)
    assert model.pos_embed.shape == (1, 256, 256)  # 32x32 -> 16x16 tokens after the max-pool
    assert len(model.blocks) == 7
    for block in model.blocks:
        assert block.attn.num_heads == 4 and block.attn.qkv.bias is None
        assert block.attn.attn_drop.p == pytest.approx(0.1)
        assert block.mlp.fc1.out_features == 512 and isinstance(block.mlp.act, nn.GELU)
    assert isinstance(model.blocks[0].drop_path1, nn.Identity)
    rates = [b.drop_path1.drop_prob for b in model.blocks[1:]]
    assert rates == pytest.approx([0.1 * i / 6 for i in range(1, 7)])


def test_cct_7_3x1_parameter_count() -> None:
    """3,783,269 parameters for 100 classes; the paper's 3.76M is the 10-class (CIFAR-10) count."""
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    per_layer = 2 * 512 + 256 * 768 + (256 * 256 + 256) + (256 * 512 + 512) + (512 * 256 + 256)
    by_hand = 3 * 256 * 9 + 256 * 256 + 7 * per_layer + 512 + 257 + (256 * 100 + 100)
    assert count(timm.create_model("cct_7_3x1_32", num_classes=100)) == by_hand == 3_783_269
    assert round(count(timm.create_model("cct_7_3x1_32", num_classes=10)) / 1e4) == 376


def test_vit_paper_configuration() -> None:
    model = timm.create_model("vit_paper_p8_64", num_classes=200)
    assert model.patch_embed.patch_size == (8, 8) and model.patch_embed.num_patches == 64
    assert model.embed_dim == 192 and len(model.blocks) == 9
    for block in model.blocks:
        assert block.attn.num_heads == 12 and block.attn.head_dim == 16
        assert block.mlp.fc1.out_features == 384
    assert model.blocks[-1].drop_path1.drop_prob == pytest.approx(0.1)
    assert model.pretrained_cfg["input_size"] == (3, 64, 64)
