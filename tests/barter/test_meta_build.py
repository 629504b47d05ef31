"""`barter.meta_build`: a model built and wrapped on the meta device, then materialised, holds bit for bit the values of
the same model built on the CPU and wrapped there (the kept units of every tensor, the generator left where the CPU
build leaves it), while the replay holds one tensor at a time, not the model. Builds that alias, tie, copy and fill
in pieces replay as they ran; one that reads a value it made is refused by name."""
from __future__ import annotations

import math

import pytest
import torch
from tiny_vit import build_vit
from torch import nn

import barter
from barter.meta_build import MetaBuildError, materialise, record_build

pytest.importorskip("timm")
X = torch.zeros(2, 3, 32, 32)


def _wrapped_on_cpu_and_on_meta(init: str, density: float):
    """The tiny ViT built (seed 0) and wrapped on the CPU, the generator's state after; the same on meta,
    materialised, and the generator's state after."""
    direct = build_vit()
    barter.wrap(direct, total_steps=12, density=density, example_inputs=(X,), init=init)
    after_direct = torch.get_rng_state()
    torch.manual_seed(7)  # whatever ran before: the replay draws from the state the build started in
    model, record = record_build(build_vit)  # seeds the generator itself
    ctl = barter.wrap(model, total_steps=12, density=density, example_inputs=(X.to("meta"),), init=init)
    replayed = materialise(model, record, "cpu", controller=ctl)
    return direct, after_direct, model, replayed


@pytest.mark.parametrize(("init", "density"), [("first", 0.5), ("random", 0.5), ("random", 0.25), ("first", 1.0)])
def test_a_meta_build_materialised_equals_the_cpu_build_at_the_units_kept(init: str, density: float) -> None:
    direct, after_direct, model, replayed = _wrapped_on_cpu_and_on_meta(init, density)
    assert torch.equal(torch.get_rng_state(), after_direct)
    expected = direct.state_dict()
    assert model.state_dict().keys() == expected.keys()
    for name, value in model.state_dict().items():
        assert torch.equal(value, expected[name]), name
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    assert torch.equal(model.eval()(x), direct.eval()(x))
    largest = max(math.prod(p.shape) * p.element_size() for p in build_vit().parameters())
    assert replayed.peak_bytes <= 2 * largest and replayed.peak_bytes < replayed.model_bytes / 4  # not the model


class Built(nn.Module):
    """A build that aliases, ties, copies from one parameter into another, fills a tensor in pieces through views,
    draws into a tensor it later overwrites whole, reads a tensor before drawing it again whole, makes a buffer from
    a factory, and initialises with torch's initialisers that skip meta tensors (`orthogonal_`, `dirac_`): made to
    run, they are replayed too."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(6, 4)
        self.second = nn.Linear(4, 6)
        self.tied = nn.Linear(6, 4, bias=False)
        self.tied.weight = self.first.weight
        self.table = nn.Parameter(torch.empty(5, 3))
        self.rotation = nn.Parameter(torch.empty(4, 4))
        self.conv = nn.Conv1d(3, 3, 3)
        nn.init.orthogonal_(self.rotation)
        nn.init.dirac_(self.conv.weight)
        self.register_buffer("positions", torch.arange(10).float().reshape(2, 5) / 3, persistent=False)
        with torch.no_grad():
            self.table.normal_()  # drawn, then overwritten whole: still drawn on replay
            self.table.uniform_(-1, 1)
            self.table[:, 0].fill_(2.0)
            self.table.data[1:3].mul_(self.first.weight[:2, :3])
            self.second.bias.copy_(self.first.weight[0, :6] * 2 + 1)
            self.early = nn.Parameter(self.table * 1)  # reads the table as it is now, before it is drawn again
            self.table.normal_()


def test_aliases_ties_copies_and_pieces_replay_as_they_ran() -> None:
    torch.manual_seed(3)
    direct = Built()
    after = torch.get_rng_state()
    torch.manual_seed(3)
    model, record = record_build(Built)
    assert all(t.is_meta for t in model.state_dict().values())
    materialise(model, record, torch.device("cpu"))
    assert torch.equal(torch.get_rng_state(), after)  # nothing used it since the build: as the CPU build left it
    assert model.tied.weight is model.first.weight
    for name, value in direct.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
    assert torch.equal(model.positions, direct.positions)


class ReadsAValue(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rates = torch.linspace(0, 0.1, 3).tolist()


def test_a_build_that_reads_a_value_it_made_is_refused() -> None:
    with pytest.raises(MetaBuildError, match="cannot be built on the meta device .* build it whole"):
        record_build(ReadsAValue)


def test_the_controller_state_of_a_model_still_on_meta_is_refused() -> None:
    direct = build_vit()
    saved = barter.wrap(direct, total_steps=12, density=0.5, example_inputs=(X,)).state_dict()
    with torch.device("meta"):
        model = build_vit()
    ctl = barter.wrap(model, total_steps=12, density=0.5, example_inputs=(X.to("meta"),))
    with pytest.raises(ValueError, match="meta device.*materialise it .to_empty. before ctl.load_state_dict"):
        ctl.load_state_dict(saved)
    model.to_empty(device="cpu")
    ctl.load_state_dict(saved)  # materialised: the tables and the noise follow, then take the saved state
    assert all(not table.ema.is_meta for table in ctl.tables.values())


def test_fsdp_on_meta_refuses_an_init_that_ranks_units_by_weights() -> None:
    from barter.training import TrainConfig
    from barter.training.config import ConfigError

    with pytest.raises(ConfigError, match="meta device does not have yet.*--no-fsdp-on-meta"):
        TrainConfig(fsdp=True, barter_options={"init": "magnitude"}).validate()
    TrainConfig(fsdp=True, fsdp_on_meta=False, barter_options={"init": "magnitude"}).validate()


def test_the_readme_states_the_meta_build_benchmark_as_measured(monkeypatch, capsys) -> None:
    """`python benchmarks/meta_build.py` over the timm conformance list: every build replays bit for bit or is
    refused with its reason, and the README states its count."""
    import re
    from pathlib import Path

    from benchmark_scripts import load_benchmark

    assert load_benchmark("meta_build", monkeypatch).main([]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert re.search(r"`meta build: \d+/\d+ bit-equal, \d+ refused`", readme)
    assert f"`{last}`" in readme


def test_a_transformers_build_is_recorded_with_the_initialisation_it_skips_on_meta() -> None:
    """transformers skips its weight initialisation when it finds itself built on meta (it asks where an empty
    tensor is made): the build runs as on the CPU, so its initialisation is recorded and replayed. A ViT, which draws
    by rejection (torch's trunc_normal_), is refused by that reason."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                      num_key_value_heads=2, num_hidden_layers=2, vocab_size=50)
    torch.manual_seed(0)
    direct = transformers.LlamaForCausalLM(config)
    after = torch.get_rng_state()
    torch.manual_seed(0)
    model, record = record_build(lambda: transformers.LlamaForCausalLM(config))
    torch.manual_seed(1)  # used since the build (a trainer seeds it again): the replay leaves it as it was
    found = torch.get_rng_state()
    materialise(model, record, torch.device("cpu"))
    assert torch.equal(torch.get_rng_state(), found) and not torch.equal(found, after)
    for name, value in direct.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
    vit = transformers.ViTConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_hidden_layers=1,
                                 image_size=16, patch_size=8)
    with pytest.raises(MetaBuildError, match="draw by rejection"):
        record_build(lambda: transformers.ViTForImageClassification(vit))


class Holding(nn.Module):
    """A model whose wrapped part is a submodule (as `BarterCallback(module="vit")` wraps)."""

    def __init__(self) -> None:
        super().__init__()
        self.vit = build_vit()
        self.extra = nn.Linear(5, 2)


def test_a_wrapped_submodule_keeps_its_units_in_the_whole_models_values() -> None:
    direct = Holding()
    barter.wrap(direct.vit, total_steps=12, density=0.5, example_inputs=(X,))
    model, record = record_build(Holding)
    ctl = barter.wrap(model.vit, total_steps=12, density=0.5, example_inputs=(X,))
    materialise(model, record, "cpu", controller=ctl)
    for name, value in direct.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
