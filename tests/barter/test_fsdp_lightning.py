"""BarterCallback in a lightning.Trainer under its FSDP2 strategy (`ModelParallelStrategy`) on two gloo processes:
the callback wraps the whole model in `setup`, the module's `configure_model` shards it with fully_shard, the optimizer
is built on the sharded parameters, and transfers chosen on non-zero scores run on the sharded model; both ranks log
the same events, keep the budgets, and end with identical gathered parameters."""
import os
from datetime import timedelta

import pytest

pytest.importorskip("lightning")
timm = pytest.importorskip("timm")

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from forked import WORLD, assert_sharded_ranks_agree, fork_processes, free_ports, load_ranks  # noqa: E402
from integrations.test_lightning import TinyViT  # noqa: E402
from lightning.pytorch.strategies import ModelParallelStrategy  # noqa: E402
from torch.distributed.fsdp import FSDPModule, fully_shard  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from barter.fsdp import gathered_state_dict  # noqa: E402
from barter.integrations.lightning import BarterCallback  # noqa: E402

OPTIONS = {"density": 0.5, "seed": 0, "window": (0.1, 0.9), "head_ratio": 1.0, "channel_ratio": 0.5}


class ShardedViT(TinyViT):
    """The tiny timm ViT, which `configure_model` shards per block and at the root on the strategy's mesh."""

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        for block in self.net.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self.net, mesh=mesh)


class ScoresBeforeEachStep(pl.Callback):
    """Records, after each optimizer step and before the controller's transfers (its hook comes later), the score
    mass each kind's transfers would be chosen on."""

    def __init__(self, barter_callback: BarterCallback) -> None:
        self.barter_callback, self.scores = barter_callback, []

    def on_fit_start(self, trainer, pl_module):
        tables = self.barter_callback.controller.tables
        trainer.optimizers[0].register_step_post_hook(lambda *_: self.scores.append(
            {kind: float(t.ema.abs().sum() + t.pending.abs().sum()) for kind, t in tables.items()}))


def worker(rank, port, out_dir):
    """One process as torchrun starts it: the strategy reads the environment and launches nothing."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      GROUP_RANK="0", WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD), TORCHELASTIC_RUN_ID="test")
    callback = BarterCallback(module="net", **OPTIONS)
    scores = ScoresBeforeEachStep(callback)
    strategy = ModelParallelStrategy(data_parallel_size=WORLD, tensor_parallel_size=1, timeout=timedelta(minutes=2))
    trainer = pl.Trainer(accelerator="cpu", devices=WORLD, max_epochs=3, logger=False, callbacks=[scores, callback],
                         strategy=strategy, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    generator = torch.Generator().manual_seed(0)
    images, labels = torch.randn(32, 3, 32, 32, generator=generator), torch.randint(0, 4, (32,), generator=generator)
    model = ShardedViT()
    try:  # half the batch of 8 per process
        trainer.fit(model, DataLoader(TensorDataset(images, labels), batch_size=4))
        ctl = callback.controller
        torch.save({"events": ctl.events, "scores": scores.scores, "sharded": isinstance(model.net, FSDPModule),
                    "counts": {kind: [g.count for g in ctl.layers[kind]] for kind in ctl.layers},
                    "initial": ctl.initial, "steps": ctl.step_count, "params": gathered_state_dict(model)},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_lightnings_fsdp2_strategy_transfers_on_the_sharded_model(tmp_path):
    fork_processes(worker, free_ports(1)[0], str(tmp_path))
    ranks = load_ranks(tmp_path)
    first = ranks[0]
    assert first["sharded"] and first["steps"] == 12
    assert_sharded_ranks_agree(ranks)
    assert ranks[1]["counts"] == first["counts"]
    for kind, counts in first["counts"].items():
        assert sum(counts) == sum(first["initial"][kind])  # budgets conserved
