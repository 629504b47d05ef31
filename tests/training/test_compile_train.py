"""`barter train --compile`: training steps run through torch.compile with the transfers and results of eager
training (dynamo's "eager" backend keeps the test free of code generation; guards do not depend on it)."""
import functools

from barter.compiling import compile_model
from barter.training import TrainConfig, session, train
from barter.training.cli import build_parser, config_from_args
from barter.training.runlog import load_checkpoint


def config(tmp_path, compile_steps):
    return TrainConfig(dataset="fake", fake_size=64, batch_size=16, epochs=2, lr=2e-3, warmup_epochs=0.5,
                       device="cpu", out_dir=str(tmp_path), progress=False, density=0.5, method="barter",
                       model="vit_paper_p8_64_tiny", img_size=16, model_kwargs={"patch_size": 4},
                       barter_options={"window": (0.1, 0.9)}, compile=compile_steps, name=str(compile_steps))


def test_compiled_run_equals_eager_run(tmp_path, monkeypatch):
    monkeypatch.setattr(session, "compile_model", functools.partial(compile_model, backend="eager"))
    eager, compiled = train(config(tmp_path, False)), train(config(tmp_path, True))
    assert compiled.transfers == eager.transfers > 0
    events = [load_checkpoint(tmp_path / name / "last")["controller"]["events"] for name in ("False", "True")]
    assert events[0] == events[1]


def test_compile_flag():
    assert config_from_args(build_parser().parse_args(["train", "--compile"]))[0].compile
