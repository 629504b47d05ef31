"""Averaged copies (timm ModelEmaV3, torch AveragedModel) follow every transfer of the live model."""
import copy

import pytest
import torch
from tiny_vit import build_vit, vit_batch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import barter

timm = pytest.importorskip("timm")
from timm.utils import ModelEmaV3  # noqa: E402

T = 30
HEAD_DIM = 16


def mask_donor(model, event):
    """Zero the event's donor output slice (timm ViT names), the reference of removing it."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        if event["kind"] == "head":
            i = event["donor_index"]
            params[f"{event['donor_layer']}.proj.weight"][:, HEAD_DIM * i:HEAD_DIM * (i + 1)] = 0
        else:
            params[f"{event['donor_layer']}.fc2.weight"][:, event["donor_index"]] = 0
    return model


EMAS = {
    "timm_v3": lambda model: ModelEmaV3(model, decay=0.9),
    "averaged_model": lambda model: AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9)),
}
UPDATES = {"timm_v3": lambda ema, model, step: ema.update(model, step=step),
           "averaged_model": lambda ema, model, step: ema.update_parameters(model)}


@pytest.mark.parametrize("kind", sorted(EMAS))
def test_averaged_copy_follows_transfers_and_clones_keep_its_outputs(kind):
    model = build_vit()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ctl = barter.wrap(model, opt, total_steps=T, density=0.5, noise_std=0.0)
    ema = EMAS[kind](model)
    ctl.track(ema)
    probe = vit_batch(-1)[0]
    for step in range(T):
        x, y = vit_batch(step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        before, events = copy.deepcopy(ema.module), len(ctl.events)
        opt.step()
        new = [e for e in ctl.events[events:] if e["skipped"] is None]
        for event in new:
            mask_donor(before, event)
        if new:  # removal equals masking the donor; the clone half changes nothing
            with torch.no_grad():
                torch.testing.assert_close(ema.module.eval()(probe), before.eval()(probe), atol=1e-5, rtol=1e-4)
        UPDATES[kind](ema, model, step)
        assert {n: p.shape for n, p in ema.module.named_parameters()} == \
            {n: p.shape for n, p in model.named_parameters()}
    assert sum(e["skipped"] is None for e in ctl.events) >= 2


def test_an_averaged_copy_of_the_dense_model_is_refused():
    model = build_vit()
    ema = ModelEmaV3(model)
    ctl = barter.wrap(model, total_steps=T, density=0.5)
    with pytest.raises(ValueError, match="after barter.wrap"):
        ctl.track(ema)


def test_an_averaged_copy_follows_layers_its_own_analysis_cannot_find():
    """Compact at one head a layer, heads mixed by heads x heads maps are no group an analysis of the copy can find
    (a 1 x 1 map does not tell which axis is the head's); the copy follows the live model's groups, through a layer
    emptied of heads and its receiver."""
    from zoo_mixed import MixedStyle, MixedTransformer

    torch.manual_seed(0)
    model = MixedTransformer(MixedStyle(heads=2, head_dim=4, mlp_hidden=4, mixing="pre_post"))
    x = torch.randn(2, 6, 5)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ctl = barter.wrap(model, opt, total_steps=6, density=0.5, example_inputs=(x,), window=(0.1, 0.9),
                      head_ratio=1.0, noise_std=0.0)
    ema = ModelEmaV3(model, decay=0.9)
    ctl.track(ema)
    for step in range(6):
        opt.zero_grad()
        model(x).square().mean().backward()
        before = copy.deepcopy(ema.module)
        opt.step()
        for event in [e for e in ctl.events if e["step"] == step + 1 and e["skipped"] is None]:
            params = dict(before.named_parameters())
            with torch.no_grad():  # the donor masked: its output columns and its rows of the mixing maps
                if event["kind"] == "head":
                    i = event["donor_index"]
                    params[f"{event['donor_layer']}.proj.weight"][:, 4 * i:4 * (i + 1)] = 0
                    params[f"{event['donor_layer']}.pre"][i] = 0
                    params[f"{event['donor_layer']}.post"][i] = 0
                else:
                    params[f"{event['donor_layer']}.fc2.weight"][:, event["donor_index"]] = 0
            with torch.no_grad():
                torch.testing.assert_close(ema.module(x), before(x), atol=1e-6, rtol=1e-5)
        ema.update(model, step=step)
        assert {n: p.shape for n, p in ema.module.named_parameters()} == \
            {n: p.shape for n, p in model.named_parameters()}
    assert [e["kind"] for e in ctl.events if e["skipped"] is None].count("head") >= 1
    assert 0 in {g.count for g in ctl.surgeon.groups if g.kind == "head"}
