"""Fine-tuning from a trained model (`init_from`: a dense run or a timm weights file): the compact model starts from
the source's weights at the kept positions, the classifier is new only for another class count, and the config and
CLI refuse bad values of init "score", calibration and allocation."""
import re
import warnings
from pathlib import Path

import pytest
import torch
from interrupted import cut_and_resume
from safetensors.torch import save_file

from barter.compact_init import initial_count
from barter.rebuild import timm_with_models
from barter.training import ConfigError, TrainConfig, train
from barter.training.cli import main
from barter.training.pretrained import TRAINED_START_EVIDENCE, TrainedStartWarning, wrap_options
from barter.training.runlog import CheckpointError, load_checkpoint
from barter.training.session import build_data, build_session

WIDTH, HEAD_DIM, HEADS, CHANNELS = 48, 16, 3, 96  # vit_paper_p8_64_tiny
MODEL = {"model": "vit_paper_p8_64_tiny", "img_size": 16, "model_kwargs": {"patch_size": 4}}


def config(out, **kw) -> TrainConfig:
    """One epoch of 4 steps (64 fake images, batch 16) of the tiny ViT, on the CPU."""
    base = {"dataset": "fake", "fake_size": 64, "batch_size": 16, "epochs": 1, "lr": 2e-3, "warmup_epochs": 0.5,
            "device": "cpu", "out_dir": str(out), "progress": False, "density": 0.5, **MODEL}
    return TrainConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A dense run and its best weights."""
    out = tmp_path_factory.mktemp("source")
    result = train(config(out, method="dense", name="dense"))
    return result.run_dir, load_checkpoint(result.run_dir / "best")["model"]


def start(cfg: TrainConfig):
    """The session of `cfg` as training starts (init_from loaded, the method built)."""
    return build_session(cfg, build_data(cfg), torch.device("cpu"), total_steps=4, pretrained=True)


def columns_of(units: list[int], per_unit: int, outer: int = 1, units_total: int = 1) -> list[int]:
    """Positions of `units` along an axis laid out [outer][unit][per_unit]."""
    return [o * units_total * per_unit + u * per_unit + r for o in range(outer) for u in units for r in range(per_unit)]


def expected_compact(dense: dict, kept: dict[str, list[int]]) -> dict[str, torch.Tensor]:
    """The source's tensors cut to the kept heads and channels (qkv rows [q|k|v][head][dim], projection columns
    [head][dim], fc1 rows and bias, fc2 columns)."""
    out = dict(dense)
    for i in range(2):
        heads, channels = kept[f"blocks.{i}.attn:head"], kept[f"blocks.{i}.mlp:channel"]
        attn, mlp = f"blocks.{i}.attn", f"blocks.{i}.mlp"
        out[f"{attn}.qkv.weight"] = dense[f"{attn}.qkv.weight"][columns_of(heads, HEAD_DIM, 3, HEADS)]
        out[f"{attn}.proj.weight"] = dense[f"{attn}.proj.weight"][:, columns_of(heads, HEAD_DIM, 1, HEADS)]
        out[f"{mlp}.fc1.weight"] = dense[f"{mlp}.fc1.weight"][channels]
        out[f"{mlp}.fc1.bias"] = dense[f"{mlp}.fc1.bias"][channels]
        out[f"{mlp}.fc2.weight"] = dense[f"{mlp}.fc2.weight"][:, channels]
    return out


def masked_source(dense: dict, kept: dict[str, list[int]]) -> torch.nn.Module:
    """The dense source model with every unit not kept silenced (its output columns zeroed)."""
    model = timm_with_models().create_model(MODEL["model"], num_classes=10, img_size=16, **MODEL["model_kwargs"])
    model.load_state_dict(dense)
    with torch.no_grad():
        for i, block in enumerate(model.blocks):
            dropped_heads = [h for h in range(HEADS) if h not in kept[f"blocks.{i}.attn:head"]]
            block.attn.proj.weight[:, columns_of(dropped_heads, HEAD_DIM, 1, HEADS)] = 0
            dropped = [c for c in range(CHANNELS) if c not in kept[f"blocks.{i}.mlp:channel"]]
            block.mlp.fc2.weight[:, dropped] = 0
    return model.eval()


@pytest.mark.parametrize("options,calibration", [({"init": "score"}, 2),
                                                 ({"init": "score", "allocation": "global"}, 2),
                                                 ({"init": "magnitude"}, None)])
def test_a_compact_start_holds_the_sources_true_columns(source, tmp_path, options, calibration):
    run, dense = source
    session = start(config(tmp_path, method="barter", init_from=str(run), barter_options=options,
                           calibration=calibration))
    kept = session.method.initial_units
    if options.get("allocation") != "global":
        assert all(len(units) == initial_count(HEADS if name.endswith("head") else CHANNELS, 0.5)
                   for name, units in kept.items())
    state = session.model.state_dict()
    expected = expected_compact(dense, kept)
    assert state.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(state[name], tensor), name
    x = torch.randn(4, 3, 16, 16)
    session.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(session.model(x), masked_source(dense, kept)(x), rtol=1e-5, atol=1e-5)


def test_the_classifier_is_new_only_for_another_class_count(source, tmp_path):
    run, dense = source
    weights = tmp_path / "dense.safetensors"
    save_file(dense, weights)
    for init_from in (str(run), str(weights)):
        same = start(config(tmp_path, method="dense", init_from=init_from)).model.state_dict()
        assert all(torch.equal(same[k], v) for k, v in dense.items()), init_from
        other = start(config(tmp_path, method="dense", init_from=init_from,
                             model_kwargs={"patch_size": 4, "num_classes": 7})).model.state_dict()
        assert other["head.weight"].shape == (7, WIDTH)
        assert all(torch.equal(other[k], v) for k, v in dense.items() if not k.startswith("head.")), init_from
        with pytest.raises(CheckpointError, match="do not fit"):  # a third block the source lacks is no fresh start
            start(config(tmp_path, method="dense", init_from=init_from,
                         model_kwargs={"patch_size": 4, "num_classes": 7, "depth": 3}))
    with pytest.raises(CheckpointError, match="no weights file"):
        start(config(tmp_path, method="dense", init_from=str(tmp_path / "missing.safetensors")))


def test_a_global_allocation_from_init_from_resumes(source, tmp_path, monkeypatch):
    """The resumed run's wrap chooses its widths on the source's weights again, so the checkpoint fits."""
    run, _ = source
    cut = config(tmp_path, method="barter", init_from=str(run), epochs=2, name="cut", calibration=1,
                 barter_options={"init": "score", "allocation": "global", "window": (0.1, 0.9)})
    result = cut_and_resume(monkeypatch, cut, crash_at=2)
    assert result.steps == 8


@pytest.mark.parametrize("kw,match", [
    ({"barter_options": {"init": "score"}}, "set calibration"),
    ({"barter_options": {"init": "first"}, "calibration": 2}, "init 'score' only"),
    ({"method": "dense", "calibration": 2}, "init 'score' only"),
    ({"barter_options": {"init": "score"}, "calibration": 0}, "calibration must be >= 1"),
    ({"barter_options": {"allocation": "global"}}, "needs init in"),
])
def test_bad_config_values_are_refused(tmp_path, kw, match):
    with pytest.raises(ConfigError, match=match):
        config(tmp_path, method=kw.pop("method", "static"), **kw).validate()


def test_the_cli_takes_init_allocation_and_calibration(capsys):
    assert main(["train", "--init", "score", "--allocation", "global", "--calibration", "3", "--print-config"]) == 0
    printed = capsys.readouterr().out
    assert "calibration: 3" in printed and "allocation: global" in printed and "init: score" in printed
    with pytest.raises(SystemExit):
        main(["train", "--allocation", "everywhere", "--print-config"])
    assert "invalid choice" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", "--init", "score", "--print-config"])
    assert "set calibration" in capsys.readouterr().err


def test_barter_from_a_trained_model_keeps_a_layers_last_head_and_warns_only_under_the_papers_policy(source, tmp_path):
    """From a trained model a run takes min_heads 1 unless its options set it or name a policy; the paper's policy
    there (min_heads 0) warns with the measured evidence; from scratch, or for method static, nothing changes."""
    run, _ = source
    with warnings.catch_warnings():
        warnings.simplefilter("error", TrainedStartWarning)
        assert start(config(tmp_path, method="barter", init_from=str(run))).method.policy.min_heads == 1
        assert start(config(tmp_path, method="barter")).method.policy.min_heads == 0  # from scratch
        start(config(tmp_path, method="static", init_from=str(run)))  # no transfers
        assert wrap_options(config(tmp_path, method="barter", init_from=str(run),
                                   barter_options={"min_heads": 2})) == {"min_heads": 2}
    for options in ({"transfer_policy": "paper"}, {"min_heads": 0}):
        evidence = r"compress\.py .*-5\.07 points .*-0\.08 .*method static"
        with pytest.warns(TrainedStartWarning, match=evidence) as caught:
            session = start(config(tmp_path, method="barter", init_from=str(run), barter_options=options))
        assert sum(issubclass(w.category, TrainedStartWarning) for w in caught) == 1
        assert session.method.policy.min_heads == 0


def test_the_warnings_numbers_are_the_readmes_compress_variants_table():
    """Each variant's mean BARTER - Static in the README's table (as compress.py --variants wrote it) is the one the
    warning names."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    means = dict(re.findall(r"^\| barter \((\w+(?:\.\d)?)\) \| static \| 0, 1, 2, 3, 4, 5 \| [^|]+ \| ([+-]\d+\.\d\d) ",
                            readme, flags=re.M))
    assert set(means) == {"paper", "fade", "carry", "count0.5", "keephead"}
    for variant, mean in means.items():
        assert f"{mean} " in TRAINED_START_EVIDENCE, variant
