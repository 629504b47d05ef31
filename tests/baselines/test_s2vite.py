"""S²ViTE (barter.baselines.s2vite): unit drop/revive, Taylor head scores, unit masks held, compact export, resume."""
import copy

import torch
from zoo import Style, TinyTransformer

from barter.baselines.s2vite import build_s2vite, drop_and_revive

EXAMPLE = (torch.zeros(2, 4, 5, dtype=torch.float64),)
STYLE = Style(heads=3, head_dim=2, mlp_hidden=6)


def test_drop_and_revive_a_hand_built_layer():
    live = torch.tensor([True, True, True, False, False])
    importance = torch.tensor([3.0, 1.0, 2.0, 0.0, 0.0])
    growth = torch.tensor([0.0, 0.0, 5.0, 9.0, 1.0])
    # drop ceil(0.5 * 3) = 2 least important (units 1, 2); revive the 2 largest growth among the rest (3, 2)
    assert drop_and_revive(live, importance, growth, 0.5).tolist() == [True, False, True, True, False]


def tiny():
    torch.manual_seed(0)
    return TinyTransformer(STYLE).double()


def batch(step):
    return torch.randn(4, 4, 5, generator=torch.Generator().manual_seed(step), dtype=torch.float64)


def build(model, opt, **kwargs):
    return build_s2vite(model, opt, density=0.5, total_steps=40, update_interval=3, example_inputs=EXAMPLE, **kwargs)


def train(model, opt, sp, steps, start=0):
    for step in range(start, start + steps):
        model(batch(step)).square().mean().backward()
        opt.step()
        sp.step()
        opt.zero_grad()


def test_head_importance_is_the_taylor_score_of_the_output_columns():
    model = tiny()
    sp = build(model, torch.optim.SGD(model.parameters(), lr=0.1))
    model(batch(0)).square().mean().backward()
    head = next(g for g in sp.groups.values() if g.kind == "head")
    importance, growth = sp._unit_scores(head)
    proj = model.get_submodule(head.module).proj.weight
    taylor = (proj * proj.grad).view(-1, STYLE.heads, STYLE.head_dim).sum((0, 2)).abs()
    torch.testing.assert_close(importance, taylor.detach())
    assert (growth >= proj.grad.abs().view(-1, STYLE.heads, STYLE.head_dim).sum((0, 2)) - 1e-12).all()


def test_s2vite_holds_live_units_masks_dead_outputs_and_exports_an_equal_compact_model():
    model = tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sp = build(model, opt)
    live = {n: int(m.sum()) for n, m in sp.unit_masks.items()}
    assert {g.kind for g in sp.groups.values()} == {"head", "channel"}
    assert live == {n: max(1, int(0.5 * g.count)) for n, g in sp.groups.items()}
    history = []
    for step in range(12):
        train(model, opt, sp, 1, start=step)
        history.append({n: m.clone() for n, m in sp.unit_masks.items()})
        assert {n: int(m.sum()) for n, m in sp.unit_masks.items()} == live
    assert any(not torch.equal(history[0][n], history[-1][n]) for n in live)  # units were explored
    for name, g in sp.groups.items():
        for sl in g.slices:
            if sl.output:
                for i in (~sp.unit_masks[name]).nonzero().flatten().tolist():
                    assert (sl.unit(sp.tensors[sl.name], g.count, i) == 0).all()
    model.eval()
    compact = sp.export_compact(EXAMPLE)
    assert sum(p.numel() for p in compact.parameters()) < sum(p.numel() for p in model.parameters())
    x = batch(99)
    torch.testing.assert_close(compact(x), model(x), rtol=0, atol=1e-9)


def test_s2vite_resumes_identically():
    model = tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sp = build(model, opt)
    train(model, opt, sp, 5)
    saved = copy.deepcopy((model.state_dict(), opt.state_dict(), sp.state_dict()))
    train(model, opt, sp, 5, start=5)
    fresh = tiny()
    opt2 = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    sp2 = build(fresh, opt2)
    fresh.load_state_dict(saved[0])
    opt2.load_state_dict(saved[1])
    sp2.load_state_dict(saved[2])
    train(fresh, opt2, sp2, 5, start=5)
    assert all(torch.equal(sp.unit_masks[n], sp2.unit_masks[n]) for n in sp.unit_masks)
    for p, q in zip(model.parameters(), fresh.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_a_timm_vit_exports_its_live_units():
    timm = __import__("pytest").importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2, num_classes=5).double()
    example = (torch.zeros(2, 3, 32, 32, dtype=torch.float64),)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    sp = build_s2vite(model, opt, density=0.5, total_steps=10, update_interval=2, example_inputs=example)
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    for _ in range(2):
        torch.nn.functional.cross_entropy(model(x), torch.tensor([0, 1])).backward()
        opt.step()
        sp.step()
        opt.zero_grad()
    model.eval()
    compact = sp.export_compact(example)
    torch.testing.assert_close(compact(x), model(x), rtol=0, atol=1e-9)
