"""BarterCallback in a lightning.Trainer under its FSDP2 strategy (`ModelParallelStrategy`) on two gloo processes:
the callback wraps the whole model in `setup`, the module's `configure_model` shards it with fully_shard, the optimizer
is built on the sharded parameters, and transfers chosen on non-zero scores run on the sharded model; both ranks log
the same events, keep the budgets, and end with identical gathered parameters. The same module built on the meta
device with the record of its build (`BarterCallback(build_record=...)`) is wrapped there, sharded by
`configure_model`, materialised before the optimizer is built, and trains to the parameters of the module built
whole, bit for bit, in fp32 and under bf16 autocast; on meta without its record it is refused."""
import os
from datetime import timedelta
from types import SimpleNamespace

import pytest

pytest.importorskip("lightning")
timm = pytest.importorskip("timm")

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from forked import WORLD, assert_sharded_ranks_agree, fork_processes, free_ports, load_ranks  # noqa: E402
from integrations.test_lightning import TinyViT, loader  # noqa: E402
from lightning.pytorch.strategies import ModelParallelStrategy  # noqa: E402
from torch.distributed.fsdp import FSDPModule, fully_shard  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from barter.fsdp import gathered_state_dict  # noqa: E402
from barter.integrations.lightning import BarterCallback  # noqa: E402
from barter.meta_build import record_build  # noqa: E402

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
        optimizer = trainer.optimizers[0]
        stepped = [p for group in optimizer.param_groups for p in group["params"]]
        self.optimizer_holds_the_parameters = (
            {id(p) for p in stepped} == {id(p) for p in pl_module.parameters()} and not any(p.is_meta for p in stepped))
        optimizer.register_step_post_hook(lambda *_: self.scores.append(
            {kind: float(t.ema.abs().sum() + t.pending.abs().sum()) for kind, t in tables.items()}))


def worker(rank, port, out_dir, on_meta=False, precision="32-true"):
    """One process as torchrun starts it: the strategy reads the environment and launches nothing. `on_meta`: the
    module is built on the meta device, with the record of its build; `precision`: Lightning's."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      GROUP_RANK="0", WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD), TORCHELASTIC_RUN_ID="test")
    model, record = record_build(ShardedViT) if on_meta else (ShardedViT(), None)
    callback = BarterCallback(module="net", build_record=record, **OPTIONS)
    scores = ScoresBeforeEachStep(callback)
    strategy = ModelParallelStrategy(data_parallel_size=WORLD, tensor_parallel_size=1, timeout=timedelta(minutes=2))
    trainer = pl.Trainer(accelerator="cpu", devices=WORLD, max_epochs=3, logger=False, callbacks=[scores, callback],
                         strategy=strategy, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, precision=precision)
    generator = torch.Generator().manual_seed(0)
    images, labels = torch.randn(32, 3, 32, 32, generator=generator), torch.randint(0, 4, (32,), generator=generator)
    try:  # half the batch of 8 per process
        trainer.fit(model, DataLoader(TensorDataset(images, labels), batch_size=4))
        ctl = callback.controller
        torch.save({"events": ctl.events, "scores": scores.scores, "sharded": isinstance(model.net, FSDPModule),
                    "counts": {kind: [g.count for g in ctl.layers[kind]] for kind in ctl.layers},
                    "initial": ctl.initial, "steps": ctl.step_count, "params": gathered_state_dict(model),
                    "optimizer_holds_the_parameters": scores.optimizer_holds_the_parameters},
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


def test_a_module_built_on_meta_trains_under_the_fsdp2_strategy_as_the_module_built_whole(tmp_path):
    """Built on meta with its record, wrapped there, sharded by `configure_model`, then given each rank's shards of
    the values the whole build draws before the strategy builds the optimizer: the optimizer steps the materialised
    parameters, and the run makes the same transfers on the same scores and ends with the same parameters, bit for
    bit, as the module built whole; also under bf16 autocast (`bf16-mixed`), whose run differs from the fp32 one."""
    ranks = {}
    for precision in ("32-true", "bf16-mixed"):
        for on_meta in (False, True):
            out_dir = tmp_path / f"{precision}-{on_meta}"
            out_dir.mkdir()
            fork_processes(worker, free_ports(1)[0], str(out_dir), on_meta, precision)
            ranks[precision, on_meta] = load_ranks(out_dir)
    for precision in ("32-true", "bf16-mixed"):
        whole, on_meta = ranks[precision, False], ranks[precision, True]
        assert_sharded_ranks_agree(on_meta)
        first = on_meta[0]
        assert first["sharded"] and first["steps"] == 12
        assert all(rank["optimizer_holds_the_parameters"] for rank in on_meta)
        done = [e for e in first["events"] if e.skipped is None]
        assert done and all(e.donor_D > 0 and e.parent_S > 0 for e in done)
        assert first["events"] == whole[0]["events"] and first["scores"] == whole[0]["scores"]
        assert first["params"].keys() == whole[0]["params"].keys()
        for name, p in whole[0]["params"].items():
            assert torch.equal(first["params"][name], p), (precision, name)
    fp32, bf16 = ranks["32-true", True][0]["params"], ranks["bf16-mixed", True][0]["params"]
    assert any(not torch.equal(bf16[name], p) for name, p in fp32.items())


def test_a_module_on_meta_without_its_build_record_is_refused():
    with torch.device("meta"):
        model = ShardedViT()
    trainer = SimpleNamespace(strategy=SimpleNamespace(launcher=None, root_device=torch.device("cpu")))
    with pytest.raises(ValueError, match="on the meta device and nothing gives it values.*build_record=record"):
        BarterCallback(module="net", **OPTIONS).setup(trainer, model, "fit")


def fit_one_process(on_meta):
    """Three epochs of TinyViT (which has no `configure_model`: nothing shards it) in one process: the callback and
    the module."""
    model, record = record_build(TinyViT) if on_meta else (TinyViT(), None)
    callback = BarterCallback(module="net", build_record=record, **OPTIONS)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=3, logger=False, callbacks=[callback],
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, loader())
    return callback, model


def test_a_module_built_on_meta_without_configure_model_is_materialised_whole_in_setup():
    whole, whole_model = fit_one_process(on_meta=False)
    on_meta, on_meta_model = fit_one_process(on_meta=True)
    assert [e for e in whole.controller.events if e.skipped is None]
    assert on_meta.controller.events == whole.controller.events
    for (name, p), q in zip(whole_model.state_dict().items(), on_meta_model.state_dict().values()):
        assert torch.equal(q, p), name
