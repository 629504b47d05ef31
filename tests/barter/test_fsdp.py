"""BARTER under FSDP2 (fully_shard per block and at the root) on two gloo processes (forked, CPU): a tiny timm ViT
and a tiny Llama run transfers chosen on non-zero scores; both processes log the same events and hold identical
gathered parameters after every transfer, equal to one unsharded process on the same global batches; Adam's moments
follow each transfer (kept units unchanged, the new unit's zero) and, like the parameters, stay sharded: no rank keeps a
whole tensor alive behind its shard; and what BARTER cannot resize is refused: a model
sharded before the wrap, an optimizer built before sharding, a 2-D (HSDP) mesh, FSDP1 and DeepSpeed's parameters.
Fading donors and restarted bias corrections (transfer policy options) match one process too."""
import math
import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from event_checks import assert_same_events
from forked import WORLD, fork_processes
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
from torch.distributed.tensor import DTensor

import barter
from barter.fsdp import UnsupportedSharding, gathered_state_dict
from barter.training.processes import shard

timm = pytest.importorskip("timm")
transformers = pytest.importorskip("transformers")

STEPS, BATCH, VOCAB, TOKENS = 10, 8, 64, 12
OPTIONS = {"density": 0.5, "window": (0.1, 0.9), "head_ratio": 0.5, "channel_ratio": 0.05}
GENTLE = {"removal": "fade", "clone_state": "restart"}  # the transfer parts that act after the transfer's step


def vit() -> torch.nn.Module:
    # no qkv bias: the key bias's gradient is zero up to float noise, which Adam would turn into steps of +-lr
    return timm.create_model("vit_tiny_patch16_224", num_classes=5, img_size=32, patch_size=8, depth=2, embed_dim=32,
                             num_heads=4, mlp_ratio=2.0, qkv_bias=False)


def llama() -> torch.nn.Module:
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32)
    return transformers.LlamaForCausalLM(config)


def vit_case():
    def batch(step):
        g = torch.Generator().manual_seed(step)
        return torch.randn(BATCH, 3, 32, 32, generator=g), torch.randint(0, 5, (BATCH,), generator=g)

    def loss(model, x, y):
        return torch.nn.functional.cross_entropy(model(x), y)

    return vit, lambda m: m.blocks, batch, loss, {}


def llama_case():
    def batch(step):
        ids = torch.randint(0, VOCAB, (BATCH, TOKENS), generator=torch.Generator().manual_seed(step))
        return ids, ids

    def loss(model, x, y):
        return model(input_ids=x, labels=y).loss

    example = torch.randint(0, VOCAB, (2, TOKENS), generator=torch.Generator().manual_seed(0))
    return llama, lambda m: m.model.layers, batch, loss, {"example_kwargs": {"input_ids": example, "labels": example}}


CASES = {"vit": vit_case, "llama": llama_case}


def moments(model, optimizer) -> dict[str, dict[str, torch.Tensor]]:
    """{parameter name: {state key: the whole tensor}} of Adam's per-element state (collective under FSDP2)."""
    out = {}
    for name, p in model.named_parameters():
        state = optimizer.state.get(p, {})
        out[name] = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone()
                     for k, v in state.items() if v.dim()}
    return out


def held_whole(model, optimizer) -> list[str]:
    """The parameters and optimizer state tensors whose storage on this rank outgrows one shard (dim 0 split in
    WORLD, padded): a whole tensor kept alive behind its shard."""
    out = []
    for name, p in model.named_parameters():
        for key, t in [("param", p), *optimizer.state.get(p, {}).items()]:
            if isinstance(t, DTensor) and t.dim():
                shard_bytes = -(-t.shape[0] // WORLD) * math.prod(t.shape[1:]) * t.element_size()
                if t.to_local().untyped_storage().nbytes() > shard_bytes:
                    out.append(f"{name} {key}")
    return out


def check_moments_follow(ctl, event, before, after) -> None:
    """Over the donor's and receiver's tensors: the kept units' moments are the ones before the transfer; the new
    unit's (and its parent's, which restarts with it) are zero; every other tensor's moments are unchanged."""
    donor, receiver = ctl.surgeon.group(event["donor_group"]), ctl.surgeon.group(event["receiver_group"])
    touched = {sl.name for g in (donor, receiver) for sl in g.slices}
    for name in after:
        if name not in touched:
            for key, value in after[name].items():
                assert torch.equal(value, before[name][key]), name
    for sl in donor.slices:
        n = donor.count
        for key, value in after[sl.name].items():
            kept = [i for i in range(n + 1) if i != event["donor_index"]]
            for new_i, old_i in enumerate(kept):
                assert torch.equal(sl.unit(value, n, new_i), sl.unit(before[sl.name][key], n + 1, old_i)), sl.name
    for sl in receiver.slices:
        n, parent = receiver.count, event["parent_index"]
        for key, value in after[sl.name].items():
            assert event["new_index"] == n - 1
            assert not sl.unit(value, n, n - 1).any() and not sl.unit(value, n, parent).any(), sl.name
            for i in range(n - 1):
                if i != parent:
                    assert torch.equal(sl.unit(value, n, i), sl.unit(before[sl.name][key], n - 1, i)), sl.name


def train(case: str, sharded: bool, policy: dict | None = None) -> dict:
    """STEPS Adam steps of a wrapped model on fixed global batches, each process on its share; with `sharded`,
    fully_shard per block and at the root after the wrap. Returns the events, the gathered parameters after every
    executed transfer, and the scores each transfer was chosen on. `policy`: transfer policy options (the paper's
    transfers have their moments checked at every transfer)."""
    build, blocks, batch, loss_of, example = CASES[case]()
    torch.manual_seed(0)
    model = build()
    ctl = barter.wrap(model, total_steps=STEPS, seed=0, **OPTIONS, **(policy or {}), **example)
    if sharded:
        for block in blocks(model):
            fully_shard(block)
        fully_shard(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    transfers, chosen_on, checked, before = [], [], [], {}
    due = {step for steps in ctl.schedule.values() for step in steps}

    def before_transfer(*_):
        if ctl.step_count + 1 in due:
            before["moments"] = moments(model, optimizer)
            chosen_on.append({kind: float(t.ema.abs().sum() + t.pending.abs().sum()) for kind, t in ctl.tables.items()})

    def after_transfer(*_):
        if ctl.step_count in due:
            executed = [e for e in ctl.events if e["step"] == ctl.step_count and e["skipped"] is None]
            if len(executed) == 1 and not policy:  # the moments before the step's one transfer
                check_moments_follow(ctl, executed[0], before["moments"], moments(model, optimizer))
                checked.append(ctl.step_count)
            transfers.append({"step": ctl.step_count, "params": gathered_state_dict(model),
                              "held_whole": held_whole(model, optimizer) if sharded else []})

    optimizer.register_step_post_hook(before_transfer)
    ctl.attach_optimizer(optimizer)
    optimizer.register_step_post_hook(after_transfer)
    for step in range(1, STEPS + 1):
        x, y = batch(step)
        mine = shard(range(BATCH)) if sharded else list(range(BATCH))
        loss = loss_of(model, x[mine], y[mine])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return {"events": ctl.events, "transfers": transfers, "chosen_on": chosen_on, "final": gathered_state_dict(model),
            "moments_checked": checked, "counts": {k: [g.count for g in v] for k, v in ctl.layers.items()}}


def refusals() -> list[str]:
    """Each way of sharding BARTER cannot follow, tried on this process group: the messages, in order."""
    messages = []

    def refused(fn):
        with pytest.raises(UnsupportedSharding) as info:
            fn()
        messages.append(str(info.value))

    torch.manual_seed(0)
    model = vit()
    fully_shard(model)
    refused(lambda: barter.wrap(model, total_steps=4))  # sharded before the wrap
    model = vit()
    optimizer = torch.optim.Adam(model.parameters())  # built before fully_shard: steps stale parameters
    ctl = barter.wrap(model, total_steps=4)
    fully_shard(model)
    refused(lambda: ctl.attach_optimizer(optimizer))
    model = vit()
    ctl = barter.wrap(model, total_steps=4)
    fully_shard(model, mesh=init_device_mesh("cpu", (1, WORLD), mesh_dim_names=("replicate", "shard")))  # HSDP
    refused(lambda: ctl.attach_optimizer(torch.optim.Adam(model.parameters())))
    model = vit()
    ctl = barter.wrap(model, total_steps=4)
    model.blocks[0] = FullyShardedDataParallel(model.blocks[0], device_id=torch.device("cpu"))
    refused(lambda: ctl.attach_optimizer(torch.optim.Adam(model.parameters())))
    refused(lambda: barter.wrap(FullyShardedDataParallel(vit(), device_id=torch.device("cpu")), total_steps=4))
    return messages


def worker(rank, init_file, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=timedelta(minutes=2))  # a divergence fails instead of hanging
    try:
        runs = {case: train(case, sharded=True) for case in CASES}
        gentle = train("vit", sharded=True, policy=GENTLE)
        torch.save({"runs": runs, "gentle": gentle, "refusals": refusals()}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def assert_close_states(a: dict, b: dict, **tolerance) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], msg=name, **tolerance)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """What each of the WORLD processes of one forked FSDP2 run saved."""
    out = tmp_path_factory.mktemp("fsdp")
    fork_processes(worker, str(out / "init"), str(out))
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def test_fsdp2_transfers_match_one_process_and_unsupported_sharding_is_refused(ranks):
    for case in CASES:
        sharded, other = ranks[0]["runs"][case], ranks[1]["runs"][case]
        executed = [e for e in sharded["events"] if e["skipped"] is None]
        assert len(executed) >= 3 and len(sharded["moments_checked"]) >= 2, case
        assert {e["kind"] for e in executed} == {"head", "channel"}, case
        assert all(value > 0 for scores in sharded["chosen_on"] for value in scores.values()), case
        assert sharded["events"] == other["events"] and sharded["counts"] == other["counts"], case
        assert not any(t["held_whole"] for rank in ranks for t in rank["runs"][case]["transfers"]), case
        for mine, theirs in zip(sharded["transfers"], other["transfers"]):
            assert_close_states(mine["params"], theirs["params"], rtol=0, atol=0)
        single = train(case, sharded=False)
        assert_same_events(single["events"], sharded["events"])
        assert [t["step"] for t in single["transfers"]] == [t["step"] for t in sharded["transfers"]]
        for mine, alone in zip(sharded["transfers"], single["transfers"]):
            assert_close_states(mine["params"], alone["params"], rtol=0, atol=1e-5)
        assert_close_states(sharded["final"], single["final"], rtol=0, atol=1e-5)
    messages = ranks[0]["refusals"]
    assert "call barter.wrap(model, ...) first, then fully_shard" in messages[0]
    assert "build it after fully_shard" in messages[1]
    assert "2-D mesh (HSDP or tensor parallel)" in messages[2]
    assert all("FSDP1 (FullyShardedDataParallel)" in m and "FSDP2" in m for m in messages[3:])


def test_fsdp2_fades_and_restarted_bias_corrections_match_one_process(ranks):
    """Fading output weights (scaled through the sharded access) and Adam's restarted bias correction (on DTensor
    state) under FSDP2 equal one unsharded process."""
    sharded, other = ranks[0]["gentle"], ranks[1]["gentle"]
    single = train("vit", sharded=False, policy=GENTLE)
    executed = [e for e in single["events"] if e["skipped"] is None]
    assert len(executed) >= 3 and any(e["removed_at"] > e["step"] for e in executed)
    assert_same_events(sharded["events"], other["events"])
    assert_same_events(single["events"], sharded["events"])
    assert_close_states(sharded["final"], other["final"], rtol=0, atol=0)
    assert_close_states(sharded["final"], single["final"], rtol=0, atol=1e-5)


def test_deepspeed_partitioned_parameters_are_refused():
    model = vit()
    model.blocks[0].attn.qkv.weight.ds_id = 0  # what DeepSpeed ZeRO-3 marks a partitioned parameter with
    with pytest.raises(UnsupportedSharding, match="DeepSpeed partitions the parameter blocks.0.attn.qkv.weight"):
        barter.wrap(model, total_steps=4)
