"""Training FLOP counting: hand counts for Linear layers and CPU attention, and per-signature caching."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import barter.training.flops as flops
from barter.training.flops import FlopMeter, StepFlops, flop_counter

B, IN, HID, OUT = 8, 12, 20, 5


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(IN, HID), nn.ReLU(), nn.Linear(HID, OUT))


def test_linear_hand_count() -> None:
    """Forward 2*B*in*out per Linear; backward 2*B*in*out for the weight grad plus as much for the input grad.

    FlopCounterMode counts what autograd executes: the first Linear's input grad is not computed when the
    input does not require grad, so backward is exactly 2x forward only when it does.
    """
    first, second = 2 * B * IN * HID, 2 * B * HID * OUT
    model, meter = _mlp(), FlopMeter()
    target = torch.randint(0, OUT, (B,))
    meter.step(model, torch.randn(B, IN), lambda out: F.cross_entropy(out, target))
    assert meter.last == StepFlops(forward=first + second, backward=first + 2 * second, batch_size=B)
    meter.step(model, torch.randn(B, IN, requires_grad=True), lambda out: F.cross_entropy(out, target))
    assert meter.last.forward == first + second and meter.last.backward == 2 * (first + second)


def test_paper_quantities() -> None:
    step = StepFlops(forward=600, backward=1100, batch_size=3)
    assert step.forward_macs_per_image == 100  # M_fwd
    assert step.estimated_flops_per_image == 600  # 2 * (M_fwd + 2 * M_fwd)
    meter = FlopMeter()
    meter.step(_mlp(), torch.randn(B, IN), lambda out: out.sum())
    assert meter.total_macs * 2 == meter.f_total == meter.total_flops == meter.last.total


def test_cpu_sdpa_counted() -> None:
    b, h, n, d = 2, 3, 10, 4
    q, k, v = (torch.randn(b, h, n, d, requires_grad=True) for _ in range(3))
    with flop_counter() as fwd:
        out = F.scaled_dot_product_attention(q, k, v)
    with flop_counter() as bwd:
        out.sum().backward()
    by_hand = 2 * (2 * b * h * n * n * d)  # q @ k^T and attn @ v
    assert torch.ops.aten._scaled_dot_product_flash_attention_for_cpu in fwd.get_flop_counts()["Global"]
    assert fwd.get_total_flops() == by_hand
    assert bwd.get_total_flops() == 2 * by_hand


def test_signature_cached(monkeypatch: pytest.MonkeyPatch) -> None:
    counted = []
    real = flops.flop_counter
    monkeypatch.setattr(flops, "flop_counter", lambda: counted.append(1) or real())
    model, meter = _mlp(), FlopMeter()
    loss = lambda out: out.square().mean()  # noqa: E731
    for _ in range(3):
        meter.step(model, torch.randn(B, IN), loss)
    assert len(counted) == 2 and meter.signatures_counted == 1  # one forward and one backward counter
    assert meter.total_flops == 3 * meter.last.total and (meter.steps, meter.images) == (3, 3 * B)
    meter.step(model, torch.randn(B // 2, IN), loss)  # new batch size: recounted
    assert len(counted) == 4 and meter.last.batch_size == B // 2
    model[2] = nn.Linear(HID, OUT + 1)  # new parameter shapes (as after surgery): recounted
    meter.step(model, torch.randn(B, IN), loss)
    assert len(counted) == 6 and meter.signatures_counted == 3
    assert meter.last.forward == 2 * B * (IN * HID + HID * (OUT + 1))


def test_state_dict_roundtrip() -> None:
    meter = FlopMeter()
    meter.step(_mlp(), torch.randn(B, IN), lambda out: out.sum())
    restored = FlopMeter()
    restored.load_state_dict(meter.state_dict())
    assert (restored.total_flops, restored.steps, restored.images) == (meter.total_flops, 1, B)
