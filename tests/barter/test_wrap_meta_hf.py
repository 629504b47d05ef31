"""barter.wrap on a Hugging Face ViT built from its config under `torch.device("meta")` (accelerate's
`init_empty_weights` style): it wraps with no weights, is materialised by `to_empty` and transformers' own
`init_weights` at the compact widths, and trains with transfers on non-zero scores, choosing as the same model
wrapped with its weights does."""
from __future__ import annotations

import pytest
import torch
from meta_checks import assert_meta_path_equals_materialised

import barter

transformers = pytest.importorskip("transformers")
CONFIG = dict(image_size=16, patch_size=4, num_labels=3, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
              intermediate_size=64)
X = torch.zeros(2, 3, 16, 16)
OPTIONS = dict(total_steps=12, density=0.5, init="first", head_ratio=0.5, channel_ratio=0.5)


def _built(device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    with torch.device(device):
        return transformers.ViTForImageClassification(transformers.ViTConfig(**CONFIG))


def _wrapped(device: str) -> barter.Controller:
    return barter.wrap(_built(device), example_kwargs={"pixel_values": X.to(device)}, **OPTIONS)


def _train(ctl: barter.Controller, steps: int) -> None:
    opt = torch.optim.AdamW(ctl.model.parameters(), lr=3e-3)
    ctl.attach_optimizer(opt)
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 + step)
        x, y = torch.randn(4, 3, 16, 16, generator=g), torch.randint(0, 3, (4,), generator=g)
        loss = ctl.model(pixel_values=x, labels=y).loss
        opt.zero_grad()
        loss.backward()
        opt.step()


def test_a_meta_hf_vit_wraps_materialises_and_trains_with_transfers() -> None:
    ctl = _wrapped("meta")
    assert all(p.is_meta for p in ctl.model.parameters())
    assert {g.name: g.count for g in ctl.surgeon.groups} == {
        "vit.layers.0.attention:head": 2, "vit.layers.0.mlp:channel": 32,
        "vit.layers.1.attention:head": 2, "vit.layers.1.mlp:channel": 32}
    ctl.model.to_empty(device="cpu")
    torch.manual_seed(0)
    ctl.model.init_weights()  # transformers' own initialisation, on the compact widths
    assert all(torch.isfinite(p).all() for p in ctl.model.parameters())
    assert ctl.model.vit.layers[0].attention.q_proj.weight.abs().sum() > 0
    _train(ctl, 12)
    done = [e for e in ctl.events if e.skipped is None]
    assert done and all(e.donor_D > 0 and e.parent_S > 0 for e in done)
    assert all(t.device.type == "cpu" for table in ctl.tables.values() for t in (table.ema, table.pending))


def test_the_meta_hf_vit_chooses_as_the_materialised_one() -> None:
    direct, on_meta = _wrapped("cpu"), _wrapped("meta")
    assert_meta_path_equals_materialised(direct, on_meta, lambda ctl: _train(ctl, 12))
