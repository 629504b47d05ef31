"""benchmarks/scale.py's memory of a transfer under FSDP2, against what a transfer reads: the bytes it counts for the
two largest groups (their tensors and Adam moments) equal the bytes an edit gathers whole through its tensor access
(as `barter.fsdp.ShardedAccess` gathers them) when the donor and the receiver are those groups, on tiny models."""

import pytest
import torch
from benchmark_scripts import load_benchmark
from tiny_vit import build_vit

from fxsurgery import Surgeon, TensorAccess


@pytest.fixture
def scale(monkeypatch):
    return load_benchmark("scale", monkeypatch)


class Counted(TensorAccess):
    """Each tensor an edit gathers whole, counted once, with its bytes."""

    def __init__(self):
        self.read: dict[int, int] = {}

    def values(self, t: torch.Tensor) -> torch.Tensor:
        self.read[id(t)] = t.numel() * t.element_size()
        return super().values(t)


def _llama() -> tuple[torch.nn.Module, tuple, dict]:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=50, num_key_value_heads=2, max_position_embeddings=32, use_cache=False,
                                      hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=24)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config), (), {"input_ids": torch.zeros(2, 6, dtype=torch.long)}


@pytest.mark.parametrize("build", [lambda: (build_vit(), (torch.randn(2, 3, 32, 32),), {}), _llama],
                         ids=["vit", "llama"])
def test_a_transfer_gathers_what_the_benchmark_counts(scale, build) -> None:
    model, args, kwargs = build()
    s = Surgeon(model, args, kwargs)
    optimizer = torch.optim.AdamW(s.model.parameters())
    s.attach_optimizer(optimizer)
    out = s.model(*args, **kwargs)
    (out if torch.is_tensor(out) else out.logits).sum().backward()
    optimizer.step()
    sizes = scale.group_bytes(s.model, s)
    model_bytes = sum(p.numel() * p.element_size() for p in s.model.parameters())
    memory = scale.transfer_memory(sizes, model_bytes, ranks=8)
    order = sorted(range(len(sizes)), key=sizes.__getitem__)
    receiver, donor = s.groups[order[-1]], s.groups[order[-2]]
    counted = Counted()
    s.set_tensor_access(counted)
    s.remove(donor, 0)
    s.clone(receiver, 0)
    assert memory.gathered == sum(counted.read.values()) > 0
    assert memory.shard == model_bytes * 3 // 8
    assert 0 < memory.fraction == memory.gathered / memory.shard


def test_the_70b_time_is_extrapolated_from_a_per_block_cost_and_never_from_noise(scale):
    """Two depths whose times fall (the fixed cost hides the blocks' at shallow depths) give no extrapolation, not a
    negative time; rising times scale by the per-block cost."""
    def rows(*times):
        return [{"model": "llama_70b", "blocks": blocks, "seconds": seconds, "full_params": 70e9, "peak_rss_gib": 3.0}
                for blocks, seconds in zip((8, 16), times)]

    assert "NOT EXTRAPOLATED" in scale.extrapolated(rows(10.0, 9.5), 80)
    line = scale.extrapolated(rows(10.0, 14.0), 80)
    assert "EXTRAPOLATED from 8 and 16 blocks:    46.0 s (0.50 s per block" in line
