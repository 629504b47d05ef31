"""Activation x gradient unit scores and their running averages (method section "Scores").

`unit_scores` turns one layer's activations and gradients into per-unit d and s in a few vectorised ops.
`ScoreTable` keeps, for one unit kind, the fp32 EMAs D and S and the donor cooldowns flat over its layers.
Each backward pass adds its per-unit (d, s) into one flat `pending` tensor of shape (2, n) (a layer whose
units are used at several places of the forward, a projection shared by branches, adds each use); `fold` then
applies the EMA in one op, at the next forward of the model (`next_forward`) or at the optimizer step.

Under torch.distributed (world size > 1), `fold` first replaces `pending` by the scores of the global batch,
with one all-reduce per fold: the sample-weighted mean over the ranks of their (d, s), divided by the world
size because DistributedDataParallel averages gradients, so the loss it optimises has each rank's gradient
over the world size. With equal shares and mean losses these are the scores one process computes on the
global batch, every rank holds the same bits, and a rank's non-finite score makes every rank's non-finite.
The all-reduce makes `fold` collective whenever scores are pending: every rank runs the same forwards and
backwards, and the controller folds at every optimizer step, so nothing is pending between steps.

Mixed precision: a backward whose scores are not all finite (an fp16 overflow, which makes GradScaler skip the
step) leaves the running scores as they are and is counted in `nonfinite`, without a device sync (the EMA
update is a `torch.where` on the finiteness test). Under loss scaling the gradients the taps see are the loss
scale times the true ones, and d and s are linear in the gradient, so `record` divides by the scale the
backward ran with (`scale`, read as a device tensor): the scores are those of the unscaled loss, bit for bit
when the scale is a power of two, as GradScaler's are.
"""
from __future__ import annotations

from itertools import accumulate
from typing import Callable, Union

import torch
from torch import Tensor

from .ddp import global_batch_scores, world_size

LossScale = Callable[[], Union[Tensor, float]]  # the factor this backward's gradients carry (1.0 unscaled)


def unit_scores(a: Tensor, g: Tensor) -> Tensor:
    """(2, U) tensor of d and s for activations `a` and gradients `g` shaped (B, *rest, U, P).

    d_i = mean_b |sum_j a*g| and s_i = mean_{b,j} |a*g|, where j runs over every coordinate in rest and P.
    """
    p = a.float() * g.float()
    p = p.reshape(p.shape[0], -1, p.shape[-2], p.shape[-1])
    d = p.sum(dim=(1, 3)).abs().mean(0)
    s = p.abs_().mean(dim=(0, 1, 3))  # p is this function's own product: no second full-size temporary
    return torch.stack((d, s))


class ScoreTable:
    """Running scores and cooldowns of one unit kind, flat over its layers (layer after layer)."""

    def __init__(self, counts: list[int], beta: float, device: torch.device | str = "cpu") -> None:
        n = sum(counts)
        self.counts = list(counts)
        self.beta = beta
        self.ema = torch.zeros(2, n, device=device)  # rows D, S; fp32
        self.pending = torch.zeros(2, n, device=device)
        self.samples = 0  # batch size of the pending scores
        self.armed: set[int] = set()  # layers whose gradient hook is registered since the last fold
        self.ran: set[int] = set()  # layers tapped since the controller last looked (`take_ran`; a fold keeps it)
        self.fresh = torch.zeros((), dtype=torch.bool, device=device)  # a gradient hook wrote `pending`
        self.cool_until = torch.full((n,), -1, dtype=torch.long)  # last step at which a unit may not donate
        self.nonfinite = torch.zeros((), dtype=torch.long, device=device)  # backwards skipped, not finite
        self._offsets = [0, *accumulate(self.counts)]

    def take_ran(self) -> set[int]:
        """The layers tapped since the last call: a fold in between (reading the scores, a gradient-accumulation
        forward) does not forget them."""
        ran, self.ran = self.ran, set()
        return ran

    @property
    def D(self) -> Tensor:
        return self.ema[0]

    @property
    def S(self) -> Tensor:
        return self.ema[1]

    def layer(self, layer: int) -> tuple[Tensor, Tensor]:
        """(D, S) of one layer (views)."""
        lo, hi = self._offsets[layer], self._offsets[layer + 1]
        return self.ema[0, lo:hi], self.ema[1, lo:hi]

    def record(self, layer: int, a: Tensor, g: Tensor, scale: Tensor | float = 1.0) -> None:
        """Store this backward pass's (d, s) of `layer` for gradients `g` multiplied by the loss `scale`;
        called from the activation's gradient hook. Tensor writes only: torch.compile traces the hook into the
        graph, and a Python attribute set there would break it."""
        lo, hi = self._offsets[layer], self._offsets[layer + 1]
        scores = unit_scores(a, g)
        self.pending[:, lo:hi] += scores if isinstance(scale, float) and scale == 1.0 else scores / scale
        self.fresh.fill_(True)

    def fold(self) -> None:
        """EMA update with the last backward pass's scores: X <- beta*X + (1-beta)*x (collective, see above)."""
        if self.armed:
            if world_size() > 1:
                self.pending = global_batch_scores(self.pending, self.samples)
            finite = torch.isfinite(self.pending).all()
            update = finite & self.fresh  # a forward whose backward never ran leaves nothing to fold
            self.ema = torch.where(update, self.ema.mul(self.beta).add_(self.pending, alpha=1 - self.beta), self.ema)
            self.nonfinite += self.fresh & ~finite
            self.pending.zero_()
            self.fresh.fill_(False)
            self.armed = set()

    def next_forward(self) -> None:
        """A forward of the model begins: fold the scores of the backward before it (a forward after a backward
        without an optimizer step: gradient accumulation)."""
        if self.armed:
            self.fold()

    def tap(self, layer: int, scale: LossScale | None = None) -> Callable[[Tensor], None]:
        """Forward tap for `layer`: hooks this use's gradient (whose loss scale `scale()` gives, read when the
        gradient arrives)."""
        def fn(a: Tensor) -> None:
            if self.ema.is_meta:
                self.materialise(a.device)
            if a.requires_grad and a.shape[-2]:
                act = a.detach()
                self.samples = a.shape[0]
                self.armed.add(layer)
                self.ran.add(layer)
                a.register_hook(lambda g: self.record(layer, act, g, 1.0 if scale is None else scale()))
        return fn

    def materialise(self, device: torch.device) -> None:
        """Hold the table on ``device``: a table made for a model on the meta device (wrapped before its weights
        exist) has scored nothing, so it starts there as a fresh one, once the model runs on a real device."""
        if self.ema.is_meta:
            self.ema, self.pending = (torch.zeros(t.shape, device=device) for t in (self.ema, self.pending))
            self.fresh = torch.zeros((), dtype=torch.bool, device=device)
            self.nonfinite = torch.zeros((), dtype=torch.long, device=device)

    def blocked(self, step: int) -> Tensor:
        """Flat bool: units still in donor cooldown at `step`."""
        return self.cool_until >= step

    def remove(self, layer: int, index: int) -> None:
        """Drop a unit's scores and cooldown."""
        self.fold()
        k = self._offsets[layer] + index
        keep = torch.cat((torch.arange(k), torch.arange(k + 1, self.ema.shape[1])))
        self._resize(layer, -1, keep)

    def clone(self, layer: int, parent: int, cool_until: int) -> None:
        """Append a twin of `parent` at the end of `layer`; both get half the parent's D and S and the cooldown."""
        self.fold()
        k, end = self._offsets[layer] + parent, self._offsets[layer + 1]
        n = self.ema.shape[1]
        self.ema[:, k] /= 2
        self.cool_until[k] = cool_until
        order = torch.cat((torch.arange(end), torch.tensor([k]), torch.arange(end, n)))
        self._resize(layer, +1, order)

    def _resize(self, layer: int, delta: int, index: Tensor) -> None:
        self.ema = self.ema[:, index.to(self.ema.device)]
        self.pending = torch.zeros_like(self.ema)
        self.cool_until = self.cool_until[index]
        self.counts[layer] += delta
        self._offsets = [0, *accumulate(self.counts)]

    def state_dict(self) -> dict:
        self.fold()
        return {"counts": list(self.counts), "ema": self.ema.clone(), "cool_until": self.cool_until.clone(),
                "nonfinite": int(self.nonfinite)}

    def load_state_dict(self, sd: dict) -> None:
        self.counts = list(sd["counts"])
        self.ema = sd["ema"].to(self.ema.device, torch.float32).clone()
        self.pending = torch.zeros_like(self.ema)
        self.armed, self.ran = set(), set()
        self.fresh.fill_(False)
        self.cool_until = sd["cool_until"].clone()
        self.nonfinite.fill_(sd["nonfinite"])
        self._offsets = [0, *accumulate(self.counts)]
