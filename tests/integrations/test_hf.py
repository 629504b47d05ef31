"""BarterCallback in a real transformers.Trainer on CPU: transfers run on the Trainer's own optimizer, budgets are
conserved, a run resumed from a step checkpoint continues with the uninterrupted run's events, and under DDP (two
gloo processes) the Trainer's own DistributedDataParallel wrapper follows the transfers."""
import os
from datetime import timedelta

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import timm  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from forked import WORLD, assert_ranks_agree, fork_processes, free_ports, save_rank  # noqa: E402
from torch.multiprocessing import ProcessRaisedException  # noqa: E402
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


def train(output_dir, resume_from=None, **args_options):
    callback = BarterCallback(module="net", resume_from=resume_from, **OPTIONS)
    options = {"per_device_train_batch_size": 8, "save_strategy": "steps", "save_steps": 4, **args_options}
    args = TrainingArguments(output_dir=str(output_dir), num_train_epochs=3, learning_rate=1e-3,
                             lr_scheduler_type="linear", logging_strategy="no", report_to=[], use_cpu=True, seed=0,
                             disable_tqdm=True, **options)
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


def ddp_worker(rank, port, out_dir):
    """One torchrun-like process: the Trainer runs DDP itself (accelerate reads the environment)."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD))
    AcceleratorState._reset_state(reset_partial_state=True)  # the fork copied this process's one-process state
    GradientState._reset_state()
    try:  # half the batch per process: the global batch and the 12 steps of the one-process run
        callback, model, trainer = train(os.path.join(out_dir, "run"), per_device_train_batch_size=4,
                                         save_strategy="no", ddp_backend="gloo", ddp_timeout=120)
        assert isinstance(trainer.model_wrapped, torch.nn.parallel.DistributedDataParallel)
        ctl = callback.controller
        save_rank(out_dir, rank, ctl, model, (ctl.step_count, trainer.state.global_step))
    finally:
        dist.destroy_process_group()


def test_ddp_ranks_make_the_same_transfers_and_keep_identical_weights(tmp_path):
    fork_processes(ddp_worker, free_ports(1)[0], str(tmp_path))
    assert_ranks_agree(tmp_path, (12, 12))


def unwrapped_worker(rank, init_file, out_dir):
    """A process group the Trainer does not know of: it trains each process's model without DDP."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=timedelta(minutes=2))
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    try:
        train(out_dir, save_strategy="no")
    finally:
        dist.destroy_process_group()


def test_a_distributed_run_without_ddp_is_refused(tmp_path):
    with pytest.raises(ProcessRaisedException, match="run the model through DistributedDataParallel"):
        fork_processes(unwrapped_worker, str(tmp_path / "init"), str(tmp_path))
