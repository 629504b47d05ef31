"""Scores: d, s and their EMAs equal an autograd reference (retain_grad on the activation)."""
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from barter.scores import ScoreTable, unit_scores


class TinyBlock(nn.Module):
    """Heads and an FFN whose activations go through `taps` exactly as fxsurgery's taps hand them over."""

    def __init__(self, dim=8, heads=2, hidden=6):
        super().__init__()
        self.heads, self.hd = heads, dim // heads
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)
        self.taps = {}
        self.kept = {}

    def forward(self, x):
        B, N, E = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, self.heads, self.hd).permute(2, 0, 3, 1, 4)
        o = (q @ k.transpose(-1, -2) / self.hd ** 0.5).softmax(-1) @ v  # B, H, N, hd
        a = o.transpose(1, 2)  # B, N, H, hd: head outputs before the output projection
        self._tap("head", a)
        x = x + self.proj(a.reshape(B, N, E))
        h = nn.functional.gelu(self.fc1(x)).unsqueeze(-1)  # B, N, C, 1
        self._tap("channel", h)
        return x + self.fc2(h.squeeze(-1))

    def _tap(self, kind, a):
        if a.requires_grad:
            a.retain_grad()
        self.kept[kind] = a
        if kind in self.taps:
            self.taps[kind](a)


def reference(a, g):
    """Per-unit loop, written independently of unit_scores."""
    B, U = a.shape[0], a.shape[-2]
    d, s = torch.zeros(U, dtype=torch.float64), torch.zeros(U, dtype=torch.float64)
    for i in range(U):
        p = (a[..., i, :] * g[..., i, :]).double().reshape(B, -1)
        d[i] = p.sum(1).abs().mean()
        s[i] = p.abs().mean()
    return d, s


def test_unit_scores_matches_reference_with_extra_lead_dims():
    a, g = torch.randn(3, 4, 5, 2, 7), torch.randn(3, 4, 5, 2, 7)
    d, s = unit_scores(a, g).double()
    rd, rs = reference(a, g)
    torch.testing.assert_close(d, rd, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(s, rs, rtol=1e-5, atol=1e-6)


def test_table_ema_matches_autograd_over_steps():
    torch.manual_seed(0)
    block = nn.Sequential(TinyBlock(), TinyBlock())
    beta = 0.9
    tables = {k: ScoreTable([2, 2] if k == "head" else [6, 6], beta) for k in ("head", "channel")}
    for layer, blk in enumerate(block):
        for kind, table in tables.items():
            blk.taps[kind] = table.tap(layer)
    opt = torch.optim.SGD(block.parameters(), lr=0.1)
    ema = {k: torch.zeros(2, t.ema.shape[1], dtype=torch.float64) for k, t in tables.items()}
    for _ in range(4):
        x = torch.randn(3, 5, 8)
        loss = block(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        for kind, table in tables.items():
            ref = torch.cat([torch.stack(reference(blk.kept[kind], blk.kept[kind].grad)) for blk in block], 1)
            ema[kind] = beta * ema[kind] + (1 - beta) * ref
            table.fold()
            assert table.ema.dtype == torch.float32
            torch.testing.assert_close(table.ema.double(), ema[kind], rtol=1e-5, atol=1e-8)
    # a forward without backward (evaluation) changes nothing
    with torch.no_grad():
        block(torch.randn(3, 5, 8))
    torch.testing.assert_close(tables["head"].ema.double(), ema["head"], rtol=1e-5, atol=1e-8)


def test_next_forward_folds_the_previous_backward():
    torch.manual_seed(1)
    blk = TinyBlock()
    table = ScoreTable([6], beta=0.5)
    blk.taps["channel"] = table.tap(0)
    blk.register_forward_pre_hook(lambda module, args: table.next_forward())  # as the controller does
    blk(torch.randn(2, 3, 8)).sum().backward()
    assert table.armed and table.ema.abs().sum() == 0
    ref = torch.stack(reference(blk.kept["channel"], blk.kept["channel"].grad))
    blk(torch.randn(2, 3, 8))  # the next forward folds
    torch.testing.assert_close(table.ema.double(), 0.5 * ref, rtol=1e-5, atol=1e-8)


def test_a_layer_used_twice_in_a_forward_adds_both_uses():
    """A projection shared by two branches (one FFN applied twice): each use's (d, s) adds to the layer's
    scores, and the second use does not fold the first away."""
    torch.manual_seed(2)
    blk = TinyBlock()
    table = ScoreTable([6], beta=0.5)
    blk.taps["channel"] = table.tap(0)
    uses = []

    def twice(x):
        y = blk(x)
        uses.append(blk.kept["channel"])
        z = blk(y)
        uses.append(blk.kept["channel"])
        return z

    twice(torch.randn(2, 3, 8)).sum().backward()
    table.fold()
    ref = sum(torch.stack(reference(a, a.grad)) for a in uses)
    torch.testing.assert_close(table.ema.double(), 0.5 * ref, rtol=1e-5, atol=1e-8)


def test_remove_and_clone_split_scores_and_set_cooldown():
    table = ScoreTable([2, 3], beta=0.9)
    table.ema = torch.tensor([[1.0, 2, 3, 4, 5], [10.0, 20, 30, 40, 50]])
    table.remove(1, 0)
    assert table.counts == [2, 2]
    table.clone(0, 1, cool_until=7)
    assert table.counts == [3, 2]
    torch.testing.assert_close(table.ema, torch.tensor([[1.0, 1, 1, 4, 5], [10.0, 10, 10, 40, 50]]))
    assert table.cool_until.tolist() == [-1, 7, 7, -1, -1]
    assert table.blocked(7).tolist() == [False, True, True, False, False]
    assert not table.blocked(8).any()
    D, S = table.layer(1)
    assert D.tolist() == [4, 5] and S.tolist() == [40, 50]


@st.composite
def edits(draw):
    counts = draw(st.lists(st.integers(1, 4), min_size=1, max_size=4))
    ops = draw(st.lists(st.tuples(st.booleans(), st.integers(0, 3), st.integers(0, 10)), max_size=12))
    return counts, ops


@given(edits())
def test_table_edits_match_a_list_model(case):
    counts, ops = case
    table = ScoreTable(counts, beta=0.9)
    n = sum(counts)
    table.ema = torch.stack((torch.arange(n, dtype=torch.float32), 100 + torch.arange(n, dtype=torch.float32)))
    model = [[(float(k), 100.0 + k, -1) for k in range(sum(counts[:layer]), sum(counts[:layer + 1]))]
             for layer in range(len(counts))]
    for step, (is_clone, layer, unit) in enumerate(ops):
        layer %= len(counts)
        units = model[layer]
        if not units:
            continue
        i = unit % len(units)
        if is_clone:
            d, s, _ = units[i]
            units[i] = (d / 2, s / 2, step)
            units.append(units[i])
            table.clone(layer, i, cool_until=step)
        else:
            units.pop(i)
            table.remove(layer, i)
    assert table.counts == [len(u) for u in model]
    flat = [u for units in model for u in units]
    assert table.D.tolist() == [u[0] for u in flat] and table.S.tolist() == [u[1] for u in flat]
    assert table.cool_until.tolist() == [u[2] for u in flat]
