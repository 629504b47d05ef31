"""The private torch APIs barter relies on (``barter.compat``): each works on the installed torch, one test per entry,
so an upgrade that removes or changes one fails here, by name. ``test_compat.py`` checks that none is reached from
anywhere else and that the table lists what the module reaches."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn

from barter import compat

ENTRIES = ("copy_with", "copy_plainly", "hooks_set_aside")  # torch internals no underscore marks


def test_every_entry_is_exported_and_has_its_test():
    entries = {*compat.PRIVATE_TORCH_NAMES.values(), *ENTRIES}
    assert entries == set(compat.__all__) - {"PRIVATE_TORCH_NAMES"}
    assert sorted(e for e in entries if f"test_{e.lower()}" not in globals()) == []


def test_copy_with():
    model = nn.Linear(2, 2)
    made = nn.Linear(3, 3)
    compat.copy_with(model, lambda memo: made)
    assert copy.deepcopy(model) is made and copy.deepcopy([model])[0] is made
    assert set(model.state_dict()) == {"weight", "bias"}  # nothing else about the module changes


def test_copy_plainly():
    model = nn.Linear(2, 2)
    compat.copy_with(model, lambda memo: None)
    compat.copy_plainly(model)
    compat.copy_plainly(model)  # twice: nothing to undo
    copied = copy.deepcopy(model)
    assert isinstance(copied, nn.Linear) and copied is not model and torch.equal(copied.weight, model.weight)


def test_hooks_set_aside():
    model = nn.Linear(2, 2)
    calls = []
    first = model.register_forward_hook(lambda *a: calls.append("first"))
    aside = model.register_forward_hook(lambda *a: calls.append("aside"))
    last = model.register_forward_hook(lambda *a: calls.append("last"))
    pre = model.register_forward_pre_hook(lambda *a: calls.append("pre"))
    with compat.hooks_set_aside([aside, pre]):
        model(torch.ones(2))
        copied = copy.deepcopy(model)
    assert calls == ["first", "last"]
    calls.clear()
    model(torch.ones(2))
    assert calls == ["pre", "first", "aside", "last"]  # back, in their order
    calls.clear()
    copied(torch.ones(2))
    assert calls == ["first", "last"]  # the copy made meanwhile has only the others
    first.remove()
    last.remove()
    gone = nn.Linear(2, 2).register_forward_hook(lambda *a: None)  # its module is collected: nothing to set aside
    with compat.hooks_set_aside([gone, aside]):
        calls.clear()
        model(torch.ones(2))
    assert calls == ["pre"]


def test_dynamo_config():
    config = compat.dynamo_config()
    assert isinstance(config.recompile_limit, int) and isinstance(config.accumulated_recompile_limit, int)


def test_foreach_mul_():
    a, b = torch.ones(2), torch.ones(3)
    compat.foreach_mul_([a, b], [torch.full((2,), 2.0), torch.zeros(3)])
    compat.foreach_mul_([a], 3.0)
    assert torch.equal(a, torch.full((2,), 6.0)) and torch.equal(b, torch.zeros(3))


def test_device_scale():
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    assert compat.device_scale(scaler) is None  # no scale before the first scaled loss
    scaler.scale(torch.ones(()))
    scale = compat.device_scale(scaler)
    assert torch.is_tensor(scale) and scale.item() == 8.0
    assert compat.device_scale(object()) is None


@pytest.fixture
def one_process_group():
    """A gloo process group of this process alone, for FSDP2 on CPU."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_fsdp_records(one_process_group):
    from torch.distributed.fsdp import fully_shard

    model = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 2))
    fully_shard(model[0])
    fully_shard(model)
    assert [id(r.sharded_param) for r in compat.fsdp_records(model[0])] == [id(p) for p in model[0].parameters()]
    assert [id(r.sharded_param) for r in compat.fsdp_records(model)] == [id(p) for p in model[1].parameters()]
    assert compat.fsdp_records(fully_shard(nn.Sequential(nn.ReLU()))) == []


def test_reshard_resized(one_process_group):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = fully_shard(nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 2)))
    model(torch.randn(4, 2)).sum().backward()  # lazy init and a first all-gather at the old sizes
    records = {id(r.sharded_param): r for r in compat.fsdp_records(model)}
    weight, bias, out = model[0].weight, model[0].bias, model[2].weight
    weight.custom_attribute = "kept"
    new = {weight: torch.randn(4, 2), bias: torch.randn(4), out: torch.randn(2, 4)}
    for param, values in new.items():
        compat.reshard_resized(records[id(param)], values)
    assert model[0].weight is weight and weight.custom_attribute == "kept" and weight.grad is None
    for param, values in new.items():
        assert param.shape == values.shape and torch.equal(param.full_tensor(), values)
    x = torch.randn(4, 2)
    expected = torch.relu(x @ new[weight].T + new[bias]) @ new[out].T + model[2].bias.full_tensor().detach()
    y = model(x)
    torch.testing.assert_close(y, expected)
    y.sum().backward()
    assert weight.grad.shape == (4, 2) and out.grad.shape == (2, 4)


def test_hold_empty(one_process_group):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = fully_shard(nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 2)))
    records = {id(r.sharded_param): r for r in compat.fsdp_records(model)}
    model(torch.randn(4, 2)).sum().backward()  # lazy init and a first all-gather at the old sizes
    compat.reshard_resized(records[id(model[0].weight)], torch.empty(0, 2))  # reshard_resized holds what it empties
    compat.reshard_resized(records[id(model[0].bias)], torch.empty(0))
    compat.reshard_resized(records[id(model[1].weight)], torch.empty(2, 0))

    def empty_layer() -> nn.Module:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # initialising tensors with no elements does nothing
            return fully_shard(nn.Sequential(nn.Linear(2, 0), nn.Linear(0, 2)))  # empty when sharded

    unheld = empty_layer()
    assert unheld[1].weight.to_local().shape == (0, 0)  # torch's shard of a (2, 0) tensor
    with pytest.raises(RuntimeError, match="non-empty"):
        unheld(torch.randn(4, 2)).sum().backward()
    fresh = empty_layer()
    for record in compat.fsdp_records(fresh):
        compat.hold_empty(record)
    for m in (model, fresh):
        assert [p.requires_grad for p in m.parameters()] == [False, False, False, True]
        assert m[1].weight.to_local().shape == (2, 0) and m[1].weight.full_tensor().shape == (2, 0)
        bias = m[1].bias.full_tensor().detach()
        m.zero_grad()
        y = m(torch.randn(4, 2))
        torch.testing.assert_close(y, bias.expand(4, 2))
        y.sum().backward()
        assert m[1].bias.grad.full_tensor().tolist() == [4.0, 4.0] and m[0].weight.grad is None


def test_dispatchrecorder():
    seen = []

    class Seen(compat.DispatchRecorder):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func.name())
            return func(*args, **(kwargs or {}))

    with Seen():
        torch.ones(2).mul_(3)
    assert seen == ["aten::ones", "aten::mul_.Tensor"]


def test_tree_leaves():
    assert compat.tree_leaves(((1, [2]), {"a": 3})) == [1, 2, 3]


def test_tree_map():
    assert compat.tree_map(lambda v: v * 2, ((1, [2]), {"a": 3})) == ((2, [4]), {"a": 6})


def test_written_arguments():
    x, y = torch.ones(2), torch.ones(2)
    assert compat.written_arguments(torch.ops.aten.mul_.Tensor, (x, y), {}) == [x]
    assert compat.written_arguments(torch.ops.aten.mul.Tensor, (x, y), {}) == []
    assert compat.written_arguments(torch.ops.aten.add.out, (x, y), {"out": y}) == [y]


def test_device_constructors():
    assert {torch.empty, torch.zeros, torch.tensor, torch.arange} <= compat.device_constructors()
