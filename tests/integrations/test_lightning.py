"""BarterCallback in a real lightning.Trainer on CPU: transfers run, budgets are conserved, a run resumed from an
epoch checkpoint continues with the uninterrupted run's events, and under DDP (two gloo processes) the strategy's
DistributedDataParallel wrapper follows the transfers."""
import os
from datetime import timedelta

import pytest

pytest.importorskip("lightning")

import lightning.pytorch as pl  # noqa: E402
import timm  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from forked import WORLD, assert_ranks_agree, fork_processes, free_ports, save_rank  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402
from torch.multiprocessing import ProcessRaisedException  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from barter.integrations.lightning import BarterCallback  # noqa: E402

OPTIONS = {"density": 0.5, "seed": 0, "window": (0.1, 0.9), "head_ratio": 1.0, "channel_ratio": 0.5}


class TinyViT(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2, num_classes=4,
                                     embed_dim=48, num_heads=4)
        self.example_input_array = torch.zeros(2, 3, 32, 32)

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def loader(batch_size=8):
    generator = torch.Generator().manual_seed(0)
    images, labels = torch.randn(32, 3, 32, 32, generator=generator), torch.randint(0, 4, (32,), generator=generator)
    data = TensorDataset(images, labels)
    return DataLoader(data, batch_size=batch_size)


def fit(tmp_path, ckpt_path=None, batch_size=8, **trainer_options):
    callback = BarterCallback(module="net", **OPTIONS)
    saver = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, every_n_epochs=1, save_top_k=-1)
    options = {"devices": 1, **trainer_options}
    trainer = pl.Trainer(accelerator="cpu", max_epochs=3, logger=False, callbacks=[callback, saver],
                         enable_progress_bar=False, enable_model_summary=False, **options)
    model = TinyViT()
    trainer.fit(model, loader(batch_size), ckpt_path=ckpt_path)
    return callback, model


def test_transfers_budgets_and_resume(tmp_path):
    callback, model = fit(tmp_path / "full")
    ctl = callback.controller
    executed = [e for e in ctl.events if e["skipped"] is None]
    assert executed and ctl.step_count == 12
    for kind in ("head", "channel"):
        assert sum(g.count for g in ctl.layers[kind]) == sum(ctl.initial[kind])  # budgets conserved
    assert any(e["step"] > 4 for e in executed)  # some transfers follow the checkpoint resumed from below
    checkpoint = next((tmp_path / "full").glob("epoch=0-*.ckpt"))
    resumed, resumed_model = fit(tmp_path / "resumed", ckpt_path=str(checkpoint))
    assert resumed.controller.events == ctl.events
    assert resumed.controller.topology() == ctl.topology()
    for a, b in zip(resumed_model.state_dict().values(), model.state_dict().values()):
        torch.testing.assert_close(a, b)


def ddp_worker(rank, port, out_dir):
    """One process as torchrun starts it: Lightning's "ddp" strategy reads the environment and launches nothing."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      GROUP_RANK="0", WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD), TORCHELASTIC_RUN_ID="test")
    try:  # half the batch per process: the global batch and the 12 steps of the one-process run
        callback, model = fit(os.path.join(out_dir, "run"), batch_size=4, devices=WORLD,
                              strategy=DDPStrategy(timeout=timedelta(minutes=2)))
        ctl = callback.controller
        save_rank(out_dir, rank, ctl, model, ctl.step_count)
    finally:
        dist.destroy_process_group()


def test_ddp_ranks_make_the_same_transfers_and_keep_identical_weights(tmp_path):
    fork_processes(ddp_worker, free_ports(1)[0], str(tmp_path))
    assert_ranks_agree(tmp_path, 12)


def test_processes_the_trainer_forks_are_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("MASTER_PORT", str(free_ports(1)[0]))  # the launcher would set it for the rest of the session
    with pytest.raises(ProcessRaisedException, match="cannot fit in processes the Trainer spawns or forks"):
        fit(tmp_path, devices=WORLD, strategy=DDPStrategy(start_method="fork", timeout=timedelta(minutes=2)))
