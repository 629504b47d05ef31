"""`barter train` records what each transfer did in events.jsonl (`barter.transfer_probe`), fills the delayed
fields once their step has run, and draws transfers.png."""
import json
import math

import pytest

from barter.training import TrainConfig, train
from barter.training.runlog import width_history
from barter.training.transfer_plot import plot_transfers


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Four epochs of 4 steps of a tiny CCT, transfers in steps 3 to 6: each is followed by 10 steps."""
    out = tmp_path_factory.mktemp("runs")
    config = TrainConfig(model="cct_2_3x1_32_tiny", img_size=16, dataset="fake", fake_size=64, batch_size=16,
                         epochs=4, lr=2e-3, warmup_epochs=0.5, device="cpu", out_dir=str(out), progress=False,
                         density=0.5, name="run", barter_options={"window": (0.1, 0.4)})
    result = train(config)
    events = [json.loads(line) for line in (out / "run" / "events.jsonl").read_text().splitlines()]
    return result, events


def test_events_jsonl_holds_the_scores_and_the_probe_losses_filled_when_known(run):
    result, events = run
    done = [e for e in events if e["skipped"] is None]
    assert len(done) == result.transfers >= 2
    for e in done:
        assert all(math.isfinite(e[k]) and e[k] > 0 for k in ("donor_D", "receiver_R", "parent_S")), e
        for key in ("probe_loss_before", "probe_loss_after", "probe_loss_10"):
            assert math.isfinite(e[key]), (key, e)
        assert e["probe_loss_100"] is None  # the run ended 10 steps after its last transfer
        assert len(e["update_parent"]) == len(e["update_new"]) == 10
    topology = json.loads((result.run_dir / "topology.json").read_text())
    assert width_history(topology, events)  # the readers of events.jsonl take the new fields in their stride


def test_transfers_png_is_written_for_a_run_and_for_a_run_without_probed_transfers(run, tmp_path):
    result, events = run
    assert (result.run_dir / "transfers.png").read_bytes()[:4] == b"\x89PNG"
    plot_transfers(tmp_path / "none.png", {"static": []})
    assert (tmp_path / "none.png").read_bytes()[:4] == b"\x89PNG"
