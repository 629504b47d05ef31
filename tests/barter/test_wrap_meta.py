"""barter.wrap on a model built on the meta device: compact initialisation that needs no weights works, those that
rank units by their weights refuse; after `to_empty` the controller follows the weights to their device and
training transfers on non-zero scores, choosing as the same model wrapped with its weights does."""
from __future__ import annotations

import pytest
import torch
from meta_checks import assert_meta_path_equals_materialised
from tiny_vit import build_vit, vit_batch

import barter

pytest.importorskip("timm")
X = torch.zeros(2, 3, 32, 32)


def _wrapped_on_meta(**options) -> barter.Controller:
    with torch.device("meta"):
        model = build_vit()
    return barter.wrap(model, total_steps=12, density=0.5, example_inputs=(X.to("meta"),), **options)


def _train(ctl: barter.Controller, steps: int) -> None:
    opt = torch.optim.AdamW(ctl.model.parameters(), lr=3e-3)
    ctl.attach_optimizer(opt)
    for step in range(steps):
        x, y = vit_batch(step)
        loss = torch.nn.functional.cross_entropy(ctl.model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()


@pytest.mark.parametrize("init", ["magnitude", "score"])
def test_inits_that_rank_units_by_their_weights_refuse_a_meta_model(init: str) -> None:
    with pytest.raises(ValueError, match="meta device .no weights yet.: wrap it with init='first' or 'random'"):
        _wrapped_on_meta(init=init)


def test_a_meta_model_wraps_materialises_and_trains_with_transfers() -> None:
    ctl = _wrapped_on_meta(init="first", head_ratio=0.5, channel_ratio=0.5)
    assert all(p.is_meta for p in ctl.model.parameters())
    assert ctl.model.blocks[0].attn.qkv.weight.shape == (96, 64)
    ctl.model.to_empty(device="cpu")
    torch.manual_seed(0)
    ctl.model.init_weights()  # timm's own initialisation, on the compact widths
    _train(ctl, 12)
    done = [e for e in ctl.events if e.skipped is None]
    assert done and all(e.donor_D > 0 and e.parent_S > 0 for e in done)
    assert all(t.device.type == "cpu" for table in ctl.tables.values() for t in (table.ema, table.pending))


def test_the_meta_path_chooses_as_the_materialised_path() -> None:
    torch.manual_seed(0)
    direct = barter.wrap(build_vit(), total_steps=12, density=0.5, example_inputs=(X,), head_ratio=0.5,
                         channel_ratio=0.5)
    on_meta = _wrapped_on_meta(init="first", head_ratio=0.5, channel_ratio=0.5)
    assert_meta_path_equals_materialised(direct, on_meta, lambda ctl: _train(ctl, 12))


def test_a_wrap_inside_a_meta_device_context_is_refused_naming_it() -> None:
    """Built and wrapped inside `with torch.device("meta")`: the analysis's own tensors would hold no values. The
    refusal says where to wrap instead, and the model is left as built."""
    with torch.device("meta"):
        model = build_vit()
        before = {name: tuple(p.shape) for name, p in model.named_parameters()}
        with pytest.raises(ValueError, match=r"inside a torch.device\('meta'\) context.*wrap\) it outside"):
            barter.wrap(model, total_steps=12, density=0.5, init="first", example_inputs=(X.to("meta"),))
    assert {name: tuple(p.shape) for name, p in model.named_parameters()} == before
    assert barter.wrap(model, total_steps=12, density=0.5, init="first", example_inputs=(X.to("meta"),)).surgeon.groups
