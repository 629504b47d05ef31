"""BarterCallback under the Trainer's sharding. Two gloo processes train a tiny Llama with the Trainer under
accelerate's FSDP plugin at version 2, end to end: the callback wraps before accelerate shards the model with
fully_shard, transfers chosen on non-zero scores run on the sharded model, and both ranks log the same events and end
with identical gathered parameters. accelerate enables FSDP on accelerators only (`AcceleratorState` keeps a CPU job
`MULTI_CPU`), so on CPU the test presents its state as FSDP before the Trainer is built; everything after is the
Trainer's and accelerate's own code. Under FSDP2 the callback asks for the example call it wraps on; FSDP1 and
DeepSpeed are refused naming what is supported."""
import os
from types import SimpleNamespace

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState, PartialState  # noqa: E402
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin  # noqa: E402
from forked import WORLD, assert_sharded_ranks_agree, fork_processes, free_ports, load_ranks  # noqa: E402
from torch.distributed.fsdp import FSDPModule  # noqa: E402
from torch.utils.data import Dataset  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from barter.fsdp import UnsupportedSharding, gathered_state_dict  # noqa: E402
from barter.integrations import hf  # noqa: E402
from barter.integrations.hf import BarterCallback  # noqa: E402
from barter.meta_build import record_build  # noqa: E402

VOCAB, TOKENS, STEPS = 64, 12, 6


class Tokens(Dataset):
    def __init__(self) -> None:
        self.ids = torch.randint(0, VOCAB, (48, TOKENS), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


FSDP2 = SimpleNamespace(deepspeed_plugin=None, fsdp_plugin=SimpleNamespace(fsdp_version=2))


def tiny_llama() -> torch.nn.Module:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32))


def test_under_fsdp2_the_callback_asks_for_the_call_and_steps_it_wraps_on(monkeypatch):
    monkeypatch.setattr(hf, "AcceleratorState", lambda: FSDP2)  # what the Trainer's accelerator presents
    args = SimpleNamespace(max_steps=-1)
    with pytest.raises(ValueError, match="pass BarterCallback\\(example_kwargs=...\\)"):
        BarterCallback(density=0.5).on_init_end(args, None, None, model=tiny_llama())
    with pytest.raises(ValueError, match="pass BarterCallback\\(total_steps=...\\)"):
        BarterCallback(density=0.5, example_kwargs=Tokens()[0:2]).on_init_end(args, None, None, model=tiny_llama())


def test_a_model_on_meta_without_its_build_record_is_refused():
    with torch.device("meta"):
        model = tiny_llama()
    state = SimpleNamespace(global_step=0, max_steps=4)
    with pytest.raises(ValueError, match="on the meta device and nothing gives it values.*build_record=record"):
        BarterCallback(density=0.5).on_train_begin(SimpleNamespace(device=torch.device("cpu")), state, None,
                                                   model=model, optimizer=None, train_dataloader=None)


@pytest.mark.parametrize("state, message", [
    (SimpleNamespace(deepspeed_plugin=object(), fsdp_plugin=None), "DeepSpeed partitions the parameters"),
    (SimpleNamespace(deepspeed_plugin=None, fsdp_plugin=SimpleNamespace(fsdp_version=1)), "the Trainer's FSDP1"),
])
def test_fsdp1_and_deepspeed_trainers_are_refused(monkeypatch, state, message):
    monkeypatch.setattr(hf, "AcceleratorState", lambda: state)  # what the Trainer's accelerator presents
    callback = BarterCallback(density=0.5)
    with pytest.raises(UnsupportedSharding, match=f"{message}.*supported: .*FSDP2"):
        callback.on_init_end(None, None, None, model=torch.nn.Linear(2, 2))


class ScoresBeforeEachStep(TrainerCallback):
    """Records, after each optimizer step and before the controller's transfers (its hook comes later), the score
    mass each kind's transfers would be chosen on."""

    def __init__(self, barter_callback: BarterCallback) -> None:
        self.barter_callback, self.scores = barter_callback, []

    def on_train_begin(self, args, state, control, *, optimizer, **kwargs):
        tables = self.barter_callback.controller.tables
        optimizer.optimizer.register_step_post_hook(lambda *_: self.scores.append(
            {kind: float(t.ema.abs().sum() + t.pending.abs().sum()) for kind, t in tables.items()}))


def present_fsdp2_to_accelerate(args: TrainingArguments) -> None:
    """Make this CPU process's accelerate state FSDP with the plugin `args` asks for, as it is on accelerators: the
    Trainer's Accelerator then finds it initialised and keeps it."""
    AcceleratorState._reset_state(reset_partial_state=True)  # the fork copied this process's one-process state
    GradientState._reset_state()
    state = Accelerator(cpu=True).state
    PartialState().distributed_type = DistributedType.FSDP
    state.fsdp_plugin = FullyShardedDataParallelPlugin(**args.fsdp_plugin_args)


def trainer_worker(rank, port, out_dir, on_meta=False):
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD))
    fsdp_config = {"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"], "reshard_after_forward": True}
    args = TrainingArguments(output_dir=out_dir, max_steps=STEPS, per_device_train_batch_size=4, learning_rate=1e-3,
                             logging_strategy="no", save_strategy="no", report_to=[], use_cpu=True, seed=0,
                             disable_tqdm=True, fsdp=True, fsdp_config=fsdp_config, ddp_backend="gloo", ddp_timeout=120)
    present_fsdp2_to_accelerate(args)
    try:
        model, record = record_build(tiny_llama) if on_meta else (tiny_llama(), None)
        callback = BarterCallback(density=0.5, total_steps=STEPS, example_kwargs=Tokens()[0:2], window=(0.1, 0.9),
                                  head_ratio=0.5, channel_ratio=0.05, build_record=record)
        scores = ScoresBeforeEachStep(callback)
        trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[scores, callback])
        trainer.train()
        ctl = callback.controller
        torch.save({"events": ctl.events, "schedule": ctl.schedule, "scores": scores.scores,
                    "sharded": isinstance(trainer.model, FSDPModule) and trainer.accelerator.is_fsdp2,
                    "controls": ctl.model is trainer.model, "steps": (ctl.step_count, trainer.state.global_step),
                    "params": gathered_state_dict(trainer.model)}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_the_trainer_under_accelerates_fsdp2_transfers_on_the_sharded_model(tmp_path):
    fork_processes(trainer_worker, free_ports(1)[0], str(tmp_path))
    ranks = load_ranks(tmp_path)
    first = ranks[0]
    assert first["sharded"] and first["controls"] and first["steps"] == (STEPS, STEPS)
    assert_sharded_ranks_agree(ranks)
    assert sum(p.numel() for p in first["params"].values()) < sum(p.numel() for p in tiny_llama().parameters())


def test_a_model_built_on_meta_trains_under_the_trainers_fsdp2_as_the_model_built_whole(tmp_path):
    """Built on meta with its record, wrapped there, sharded by accelerate, then given each rank's shards of the
    values the whole build draws: the same transfers on the same scores, the same parameters bit for bit."""
    for name, on_meta in (("whole", False), ("meta", True)):
        (tmp_path / name).mkdir()
        fork_processes(trainer_worker, free_ports(1)[0], str(tmp_path / name), on_meta)
    whole, on_meta = load_ranks(tmp_path / "whole"), load_ranks(tmp_path / "meta")
    assert_sharded_ranks_agree(on_meta)
    assert on_meta[0]["sharded"] and on_meta[0]["steps"] == (STEPS, STEPS)
    done = [e for e in on_meta[0]["events"] if e.skipped is None]
    assert done and all(e.donor_D > 0 and e.parent_S > 0 for e in done)
    assert on_meta[0]["events"] == whole[0]["events"] and on_meta[0]["scores"] == whole[0]["scores"]
    for name, p in whole[0]["params"].items():
        assert torch.equal(on_meta[0]["params"][name], p), name
