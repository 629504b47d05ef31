"""BarterCallback in a real transformers.Trainer on CPU: transfers run on the Trainer's own optimizer, budgets are
conserved, and a run resumed from a step checkpoint continues with the uninterrupted run's events."""
import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import timm  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import Dataset  # noqa: E402
from transformers import Trainer, TrainingArguments  # noqa: E402

from barter.integrations.hf import BarterCallback  # noqa: E402

OPTIONS = {"density": 0.5, "seed": 0, "window": (0.1, 0.9), "head_ratio": 1.0, "channel_ratio": 0.5}


class Classifier(torch.nn.Module):
    """A tiny timm ViT behind the Trainer's interface: keyword inputs in, a dict with the loss out."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2, num_classes=4,
                                     embed_dim=48, num_heads=4)

    def forward(self, pixel_values, labels=None):
        logits = self.net(pixel_values)
        return {"loss": torch.nn.functional.cross_entropy(logits, labels), "logits": logits}


class Images(Dataset):
    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.images = torch.randn(32, 3, 32, 32, generator=generator)
        self.labels = torch.randint(0, 4, (32,), generator=generator)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i):
        return {"pixel_values": self.images[i], "labels": self.labels[i]}


def train(output_dir, resume_from=None):
    callback = BarterCallback(module="net", resume_from=resume_from, **OPTIONS)
    args = TrainingArguments(output_dir=str(output_dir), per_device_train_batch_size=8, num_train_epochs=3,
                             learning_rate=1e-3, lr_scheduler_type="linear", save_strategy="steps", save_steps=4,
                             logging_strategy="no", report_to=[], use_cpu=True, seed=0, disable_tqdm=True)
    model = Classifier()
    trainer = Trainer(model=model, args=args, train_dataset=Images(), callbacks=[callback])
    params_before = [p for group in (trainer.create_optimizer().param_groups) for p in group["params"]]
    trainer.train(resume_from_checkpoint=None if resume_from is None else str(resume_from))
    optimizer_params = [p for group in trainer.optimizer.param_groups for p in group["params"]]
    assert all(a is b for a, b in zip(optimizer_params, params_before))  # compacted in place, same Parameters
    assert {id(p) for p in optimizer_params} == {id(p) for p in model.parameters()}
    return callback, model, trainer


def test_transfers_budgets_and_resume(tmp_path):
    callback, model, trainer = train(tmp_path / "full")
    ctl = callback.controller
    executed = [e for e in ctl.events if e["skipped"] is None]
    assert executed and ctl.step_count == trainer.state.global_step == 12
    for kind in ("head", "channel"):
        assert sum(g.count for g in ctl.layers[kind]) == sum(ctl.initial[kind])  # budgets conserved
    assert sum(p.numel() for p in model.parameters()) < sum(p.numel() for p in Classifier().parameters())
    assert trainer.lr_scheduler.get_last_lr()[0] == pytest.approx(0.0)  # the linear schedule ran to its end
    assert any(e["step"] > 4 for e in executed)  # some transfers follow the checkpoint resumed from below
    checkpoint = tmp_path / "full" / "checkpoint-4"
    resumed, resumed_model, _ = train(tmp_path / "resumed", resume_from=checkpoint)
    assert resumed.controller.events == ctl.events
    assert resumed.controller.topology() == ctl.topology()
    for a, b in zip(resumed_model.state_dict().values(), model.state_dict().values()):
        torch.testing.assert_close(a, b)


def test_resume_without_the_checkpoint_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a checkpoint of a BARTER run"):
        train(tmp_path / "resumed", resume_from=tmp_path)
