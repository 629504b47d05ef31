"""A host's own forward serves the calls a graph cannot (here: a forward hook on one of its modules) with the count
attributes it reads set to the current widths. Which attributes those are is fitted on copies of the host with random
parameters. Drawn small, they make attention nearly uniform, and heads split at a wrong size then compute almost what
the right split computes; so a removal is also checked on parameters at unit scale. The block below splits its heads
by ``num_heads`` and takes the head size from the channels: the fit must find ``num_heads``, and the hooked call after
removals must equal the model with those heads masked, by weights and by taps."""
from __future__ import annotations

import copy

import torch
import torch.nn as nn
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from fxsurgery import Surgeon, UnitKind

TOKENS = 6


class Attention(nn.Module):
    """Pre-norm self-attention with a residual; the head size is whatever ``num_heads`` leaves of the channels."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.num_heads = heads
        self.norm = nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, _ = x.shape
        q, k, v = self.qkv(self.norm(x)).reshape(batch, tokens, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        attention = (q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5).softmax(dim=-1)
        return x + self.proj((attention @ v).transpose(1, 2).reshape(batch, tokens, -1))


class Stack(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.blocks = nn.ModuleList([Attention(dim, heads) for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


@settings(max_examples=20 if settings.get_current_profile_name() == "ci" else 200)
@given(heads=st.sampled_from([1, 2, 4, 8]), head_size=st.sampled_from([1, 2, 4]), data=st.data())
@example(heads=4, head_size=4, data=None)  # a wrong split runs here: 3 heads' 12 channels split into 4 heads of 3
def test_a_hooked_call_after_removals_equals_masking_when_heads_split_by_an_attribute(heads: int, head_size: int,
                                                                                        data) -> None:
    """Heads removed from the first block (any number, one unit left or none where the group allows it): a call with a
    forward hook on the block's ``qkv``, which the block's own forward serves, equals the model with those heads'
    output columns zeroed, and so does zeroing them at the tap before the removal."""
    assume(heads * head_size > 1)  # one head of one channel: which size-1 dim is the head cannot be told (refused)
    dim = heads * head_size
    torch.manual_seed(0)
    model = Stack(dim, heads).double().eval()
    with torch.no_grad():  # trained weights: attention far from uniform
        for block in model.blocks:
            block.qkv.weight.mul_(4.0)
    x = torch.randn(2, TOKENS, dim, dtype=torch.float64)
    s = Surgeon(model, (x,))
    group = next(g for g in s.groups if g.module == "blocks.0")  # heads of one channel are told as channels
    assert group.count == heads and group.exact and (group.kind is UnitKind.HEAD) == (head_size > 1), s.explain()
    removable = range(heads) if group.min_count == 0 else range(heads - group.min_count)
    count = len(removable) if data is None else data.draw(st.sampled_from(list(removable) + [len(removable)]))
    removed = [1, 0, 2][:count] if data is None else data.draw(st.permutations(range(heads)))[:count]
    by_weights = copy.deepcopy(model)
    with torch.no_grad():
        for head in removed:
            by_weights.blocks[0].proj.weight[:, head * head_size:(head + 1) * head_size] = 0
        masked = by_weights(x)
    units = torch.tensor(removed, dtype=torch.long)
    handle = s.tap(group, lambda a: a.index_fill_(-2, units, 0))  # a: (..., units, per unit)
    with torch.no_grad():
        by_taps = model(x)
    handle.remove()
    assert (by_taps - masked).abs().max() < 1e-10
    for head in sorted(removed, reverse=True):
        s.remove(group, head)
    seen = []
    hook = model.blocks[0].qkv.register_forward_hook(lambda module, args, out: seen.append(out.shape[-1]))
    with torch.no_grad():
        hooked = model(x)
    hook.remove()
    assert seen == [3 * head_size * max(heads - len(removed), 1)]  # the hook ran, on the compact layer
    assert model.blocks[0].num_heads == heads  # set for the call only
    assert (hooked - masked).abs().max() < 1e-10
    with torch.no_grad():
        assert (model(x) - masked).abs().max() < 1e-10


def test_the_fit_runs_eagerly_when_a_compiled_call_meets_it(monkeypatch) -> None:
    """The fit is an analysis that runs once per kind of call: a compiled call that needs it (a layer emptied, its cache
    stored by the own forward) runs it eagerly, not traced by dynamo, which would compile each of its many steps."""
    from fxsurgery.runtime import recapture
    from fxsurgery.runtime.graph_forward import GraphForward

    torch.manual_seed(0)
    model, x = Stack(8, 2).eval(), torch.randn(2, TOKENS, 8)
    Surgeon(model, (x,))
    server = GraphForward.of(model.blocks[0]).server
    real, compiling = recapture.fit_count_attributes, []
    monkeypatch.setattr(recapture, "fit_count_attributes",
                        lambda *args, **kw: compiling.append(torch.compiler.is_compiling()) or real(*args, **kw))

    def fitted_then_scaled(t: torch.Tensor) -> torch.Tensor:
        fault = server.fit_call(("a call of its own",), ((t,), {})).fault
        return t * 2 if not fault else t

    torch._dynamo.reset()
    assert torch.equal(torch.compile(fitted_then_scaled, backend="eager")(x), x * 2)
    assert compiling and not any(compiling)
