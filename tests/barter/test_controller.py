"""Controller flow on a hand-written fake surgeon (no fx): events, cooldown, tap removal, state round trip."""
import io
import json
from dataclasses import dataclass

import torch
from torch import nn

from barter.controller import Controller
from barter.options import Options
from barter.schedule import make_schedule
from barter.training.runlog import RunDir
from barter.transfer_event import TransferEvent
from fxsurgery import UnitKind


class Block(nn.Module):
    """Attention with `heads` heads of size 2 and an FFN with `hidden` channels, resizable by the fake."""

    def __init__(self, heads=3, hidden=4, dim=6):
        super().__init__()
        self.qkv, self.proj = nn.Linear(dim, 3 * 2 * heads), nn.Linear(2 * heads, dim)
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)
        self.taps = {"head": [], "channel": []}

    def forward(self, x):
        B, N, _ = x.shape
        H = self.proj.in_features // 2
        q, k, v = self.qkv(x).reshape(B, N, 3, H, 2).permute(2, 0, 3, 1, 4)
        a = ((q @ k.transpose(-1, -2)).softmax(-1) @ v).transpose(1, 2)  # B, N, H, 2
        for fn in self.taps["head"]:
            fn(a)
        x = x + self.proj(a.reshape(B, N, 2 * H))
        h = torch.relu(self.fc1(x)).unsqueeze(-1)
        for fn in self.taps["channel"]:
            fn(h)
        return x + self.fc2(h.squeeze(-1))


@dataclass
class Group:
    block: Block
    kind: str
    module: str
    name: str
    max_count: int
    exact: bool = True

    @property
    def min_count(self):
        return 0 if self.kind == "head" else 1

    @property
    def count(self):
        return self.block.proj.in_features // 2 if self.kind == "head" else self.block.fc1.out_features


class Handle:
    def __init__(self, lst, fn):
        self.lst, self.fn = lst, fn

    def remove(self):
        self.lst.remove(self.fn)


def _rows(g, units):
    """Input rows (qkv / fc1) and output columns (proj / fc2) of the given units."""
    if g.kind == "channel":
        return list(units), list(units)
    H = g.count
    return [s * H * 2 + u * 2 + j for s in range(3) for u in units for j in range(2)], \
           [u * 2 + j for u in units for j in range(2)]


class FakeSurgeon:
    def __init__(self, model):
        self.model = model
        self.groups = []
        for i, blk in enumerate(model):
            self.groups += [Group(blk, "head", f"{i}.attn", f"{i}.attn:head", 3),
                            Group(blk, "channel", f"{i}.mlp", f"{i}.mlp:channel", 4)]

    def _mods(self, g):
        return (g.block.qkv, g.block.proj) if g.kind == "head" else (g.block.fc1, g.block.fc2)

    def _set(self, g, rows, cols, out_w):
        lin_in, lin_out = self._mods(g)
        lin_in.weight = nn.Parameter(lin_in.weight.data[rows].clone())
        lin_in.bias = nn.Parameter(lin_in.bias.data[rows].clone())
        lin_in.out_features, lin_out.in_features = len(rows), len(cols)
        lin_out.weight = nn.Parameter(out_w)

    def remove(self, g, index):
        keep = [u for u in range(g.count) if u != index]
        rows, cols = _rows(g, keep)
        self._set(g, rows, cols, self._mods(g)[1].weight.data[:, cols].clone())

    def clone(self, g, parent, noise_std=0.0, generator=None, relative=False, state=None):
        units = list(range(g.count)) + [parent]
        rows, cols = _rows(g, units)
        w = self._mods(g)[1].weight.data[:, cols].clone()
        pc = _rows(g, [parent])[1]
        half = w[:, pc] / 2
        eps = torch.randn(half.shape, generator=generator) * noise_std * (half.std() * 2 if relative else 1)
        w[:, pc], w[:, -len(pc):] = half + eps, half - eps
        self._set(g, rows, cols, w)
        return g.count - 1

    def tap(self, g, fn, *, grad_only=False):
        g.block.taps[g.kind].append(fn)
        return Handle(g.block.taps[g.kind], fn)

    def attach_optimizer(self, opt):
        pass


def make(method="barter", total=40, seed=0, counts=((2, 2), (1, 3), (2, 2))):
    torch.manual_seed(0)
    model = nn.Sequential(*[Block(h, c) for h, c in counts])
    s = FakeSurgeon(model)
    layers = {k: [g for g in s.groups if g.kind == k] for k in ("head", "channel")}
    sched = make_schedule(total, {"head": 2, "channel": 6})
    ctl = Controller(s, layers, sched, method=method, auto=False, options=Options(),
                     select_rng=torch.Generator().manual_seed(seed), noise_rng=torch.Generator().manual_seed(seed))
    return ctl


def run(ctl, steps, x=None):
    x = torch.randn(4, 5, 6, generator=torch.Generator().manual_seed(0)) if x is None else x
    diffs = []
    for step in steps:
        opt = torch.optim.SGD(ctl.model.parameters(), lr=0.05)  # params change identity in the fake
        ctl.model(x + 0.1 * step).square().mean().backward()
        opt.step()
        opt.zero_grad()
        n = len(ctl.events)
        with torch.no_grad():
            before = ctl.model(x)
        ctl.step()
        if any(e["skipped"] is None for e in ctl.events[n:]):
            with torch.no_grad():
                diffs.append((ctl.model(x) - before).abs().max().item())
    return diffs


def test_events_budgets_and_taps():
    ctl = make()
    topo0 = ctl.topology()
    run(ctl, range(1, 41))
    assert len(ctl.events) == 8
    assert sorted(e["step"] for e in ctl.events if e["kind"] == "channel") == ctl.schedule["channel"]
    topo = ctl.topology()
    for kind in ("head", "channel"):
        assert sum(v.get(kind, 0) for v in topo.values()) == sum(v.get(kind, 0) for v in topo0.values())
    assert all(not b.taps["head"] and not b.taps["channel"] for b in ctl.model)


def test_cooldown_blocks_fresh_twins():
    ctl = make()
    run(ctl, range(1, 41))
    executed = [e for e in ctl.events if e["skipped"] is None and e["kind"] == "channel"]
    L = ctl._schedule.cooldown["channel"]
    for i, e in enumerate(executed):
        for later in executed[i + 1:]:
            if later["step"] <= e["step"] + L and later["donor_layer"] == e["receiver_layer"]:
                assert later["donor_index"] not in (e["parent_index"], e["new_index"])


GOLDEN_LINE = (
    '{"step": 7, "kind": "head", "donor_layer": "0.attn", "donor_group": "0.attn:head", "donor_index": 1, '
    '"receiver_layer": "1.attn", "receiver_group": "1.attn:head", "parent_index": 0, "new_index": 1, "skipped": null, '
    '"donor_D": 0.25, "receiver_R": 0.5, "parent_S": 0.75, "probe_loss_before": 1.5, "probe_loss_after": 1.25, '
    '"probe_loss_10": 1.0, "probe_loss_100": null, "update_parent": [0.5, 0.25], "update_new": null, '
    '"update_kept": null, "removed_at": 9}')


def test_an_event_is_written_and_read_as_its_events_jsonl_line(tmp_path):
    """A probed, fading transfer's event: the same line of events.jsonl as the log has always had, read back as the
    same event; a skipped proposal's record has no probe fields and no `removed_at`."""
    event = TransferEvent(step=7, kind=UnitKind.HEAD, donor_layer="0.attn", donor_group="0.attn:head", donor_index=1,
                          receiver_layer="1.attn", receiver_group="1.attn:head", parent_index=0, new_index=1,
                          donor_D=0.25, receiver_R=0.5, parent_S=0.75, probed=True, probe_loss_before=1.5,
                          probe_loss_after=1.25, probe_loss_10=1.0, update_parent=[0.5, 0.25], removed_at=9)
    run_dir = RunDir(tmp_path)
    run_dir.write_events([event])
    assert (tmp_path / "events.jsonl").read_text() == GOLDEN_LINE + "\n"
    read = TransferEvent.from_record(run_dir.events()[0])
    assert read == event and read.kind is UnitKind.HEAD and read["skipped"] is None and read.removed_at == 9
    skipped = TransferEvent(step=3, kind=UnitKind.CHANNEL, skipped="no eligible donor")
    assert list(skipped) == list(json.loads(GOLDEN_LINE))[:13]
    assert TransferEvent.from_record(json.loads(json.dumps(dict(skipped)))) == skipped


def test_state_round_trip_continues_identically():
    """Through `torch.save` and `torch.load(weights_only=True)`: the state holds kinds as their text."""
    ref = make(method="random_donor")
    run(ref, range(1, 41))
    a = make(method="random_donor")
    run(a, range(1, 13))
    saved = io.BytesIO()
    torch.save(a.state_dict(), saved)
    saved.seek(0)
    sd, params = torch.load(saved, weights_only=True), {k: v.clone() for k, v in a.model.state_dict().items()}
    b = make(method="random_donor")
    b.load_state_dict(sd)
    b.model.load_state_dict(params)
    run(b, range(13, 41))
    assert b.events == ref.events
    for p, q in zip(ref.model.parameters(), b.model.parameters()):
        assert torch.equal(p, q)


def test_non_finite_scores_skip_the_proposal_and_training_goes_on():
    ctl = make()
    first = ctl.schedule["channel"][0]
    run(ctl, range(1, first))
    ctl.tables["channel"].ema[0, 3] = float("nan")
    run(ctl, range(first, first + 1))
    assert ctl.events[-1]["skipped"] == "non-finite scores" and ctl.events[-1]["kind"] == "channel"
    run(ctl, range(first + 1, 41))
    assert len(ctl.events) == 8
    assert all(torch.isfinite(p).all() for p in ctl.model.parameters())
