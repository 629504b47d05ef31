"""A ViT of timm's parallel blocks (one projection makes q, k, v and the MLP hidden, whose heads and channels are
segments of the same tensors) through BARTER: transfers on scores, a resume that continues identically, and
`barter.export` / `barter.load` of the compact model at its saved widths."""
import copy
import json

import pytest
import timm
import torch

import barter
from barter import ExportError

NAME = "vit_pwee_patch16_reg1_gap_256"
KWARGS = {"img_size": 32, "patch_size": 8, "depth": 2, "embed_dim": 24, "num_heads": 3, "num_classes": 5}
STEPS = 12


def images(batch: int = 4) -> torch.Tensor:
    return torch.randn(batch, 3, 32, 32, generator=torch.Generator().manual_seed(batch))


def wrapped() -> tuple[torch.nn.Module, torch.optim.Optimizer, barter.Controller]:
    torch.manual_seed(0)
    model = timm.create_model(NAME, **KWARGS)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ctl = barter.wrap(model, optimizer, total_steps=STEPS, density=0.5, window=(0.0, 1.0))
    return model, optimizer, ctl


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        torch.manual_seed(100 + step)
        model(images()).logsumexp(1).mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def test_transfers_resume_and_export_of_a_parallel_block_vit(tmp_path):
    model, optimizer, ctl = wrapped()
    assert {g.kind for g in ctl.surgeon.groups} == {"head", "channel"}
    assert all(g.count < g.max_count for g in ctl.surgeon.groups)  # compact: segments of both kinds shrank
    train(model, optimizer, range(6))
    done = [e for e in ctl.events if e["skipped"] is None]
    assert {e["kind"] for e in done} == {"head", "channel"}
    assert all(bool(ctl.tables[kind].D.abs().sum() > 0) for kind in ("head", "channel"))  # chosen on real scores

    saved = (copy.deepcopy(ctl.state_dict()), copy.deepcopy(model.state_dict()),
             copy.deepcopy(optimizer.state_dict()))
    resumed, resumed_optimizer, resumed_ctl = wrapped()
    resumed_ctl.load_state_dict(saved[0])
    resumed.load_state_dict(saved[1])
    resumed_optimizer.load_state_dict(saved[2])
    train(model, optimizer, range(6, STEPS))
    train(resumed, resumed_optimizer, range(6, STEPS))
    assert resumed_ctl.events == ctl.events
    for (key, value), other in zip(model.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(value, other), key

    path = barter.export(model, tmp_path / "model", program=False)
    assert json.loads((path / "topology.json").read_text())["model_kwargs"] == KWARGS  # num_heads off the block
    other = timm.create_model(NAME, **{**KWARGS, "num_heads": 4})  # the same shapes in 4 heads of 6
    with pytest.raises(ExportError, match="blocks.0:head has 3 units at most in the export, 4 in the"):
        barter.load(path, model=other)
    loaded = barter.load(path)
    assert sum(p.numel() for p in loaded.parameters()) == sum(p.numel() for p in model.parameters())
    for key, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], tensor), key
    model.eval(), loaded.eval()
    with torch.no_grad():
        assert torch.equal(model(images(3)), loaded(images(3)))
    again = barter.load(barter.export(loaded, tmp_path / "again", program=False))
    with torch.no_grad():
        assert torch.equal(again.eval()(images(3)), model(images(3)))
