"""`barter train --amp`: bf16 autocast and fp16 with loss scaling train through the transfers on CPU."""
import json

import pytest

from barter.training import TrainConfig, train
from barter.training.cli import build_parser, config_from_args
from barter.training.runlog import load_checkpoint


def config(tmp_path, amp):
    return TrainConfig(dataset="fake", fake_size=64, batch_size=16, epochs=2, lr=2e-3, warmup_epochs=0.5,
                       device="cpu", out_dir=str(tmp_path), progress=False, density=0.5, method="barter",
                       model="vit_paper_p8_64_tiny", img_size=16, model_kwargs={"patch_size": 4},
                       barter_options={"window": (0.1, 0.9)}, amp=amp, name=amp)


@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_mixed_precision_runs_transfer_and_log_skipped_score_batches(tmp_path, amp):
    result = train(config(tmp_path, amp))
    assert result.transfers > 0
    metrics = [json.loads(line) for line in (tmp_path / amp / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["nonfinite_score_batches"] == {"head": 0, "channel": 0}
    state = load_checkpoint(tmp_path / amp / "last")
    assert bool(state["scaler"]) == (amp == "fp16")  # GradScaler's scale and growth tracker


def test_amp_flag():
    args = build_parser().parse_args(["train", "--amp", "bf16"])
    assert config_from_args(args)[0].amp == "bf16"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--amp", "fp8"])
