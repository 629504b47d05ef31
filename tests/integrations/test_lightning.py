"""BarterCallback in a real lightning.Trainer on CPU: transfers run, budgets are conserved, and a run resumed
from an epoch checkpoint continues with the uninterrupted run's events."""
import pytest

pytest.importorskip("lightning")

import lightning.pytorch as pl  # noqa: E402
import timm  # noqa: E402
import torch  # noqa: E402
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


def loader():
    generator = torch.Generator().manual_seed(0)
    images, labels = torch.randn(32, 3, 32, 32, generator=generator), torch.randint(0, 4, (32,), generator=generator)
    data = TensorDataset(images, labels)
    return DataLoader(data, batch_size=8)


def fit(tmp_path, ckpt_path=None, **trainer_options):
    callback = BarterCallback(module="net", **OPTIONS)
    saver = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, every_n_epochs=1, save_top_k=-1)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=3, logger=False, callbacks=[callback, saver],
                         enable_progress_bar=False, enable_model_summary=False, **trainer_options)
    model = TinyViT()
    trainer.fit(model, loader(), ckpt_path=ckpt_path)
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
