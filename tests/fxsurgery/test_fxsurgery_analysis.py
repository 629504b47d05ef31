"""`fxsurgery.analyse`: a read-only value that leaves the model untouched, pickles, compares, and installs with
`Surgeon(model, analysis)` without analysing again."""
from __future__ import annotations

import copy
import dataclasses
import functools
import gc
import pickle

import pytest
import torch
import torch.nn as nn
from timm.models.vision_transformer import ParallelScalingBlock, VisionTransformer
from zoo import ConvTransformer, Style, TinyTransformer, masked_copy

from fxsurgery import Analysis, GroupDescription, Surgeon, analyse
from fxsurgery.analysis import cache as analysis_cache
from fxsurgery.analysis import install as analysis_install
from fxsurgery.analysis import value as analysis_value
from fxsurgery.analysis.value import working_copy as model_analysis_working_copy
from fxsurgery.errors import AnalysisError


def snapshot(model: nn.Module) -> dict:
    """Everything a user could observe of a model without running it."""
    return {
        "attributes": {name: sorted(vars(m)) for name, m in model.named_modules()},
        "forwards": {name: m.forward.__func__ for name, m in model.named_modules()},
        "tensors": {name: (t, t.data_ptr(), t.detach().clone()) for name, t in
                    [*model.named_parameters(), *model.named_buffers()]},
        "state_dict": list(model.state_dict()),
        "hooks": {name: (dict(m._forward_hooks), dict(m._forward_pre_hooks)) for name, m in model.named_modules()},
        "training": {name: m.training for name, m in model.named_modules()},
    }


def assert_untouched(model: nn.Module, before: dict) -> None:
    after = snapshot(model)
    for key in ("attributes", "forwards", "state_dict", "hooks", "training"):
        assert after[key] == before[key], key
    for name, (tensor, pointer, value) in before["tensors"].items():
        now, now_pointer, _ = after["tensors"][name]
        assert now is tensor and now_pointer == pointer and torch.equal(now, value), name


def test_analyse_leaves_the_model_untouched() -> None:
    """A model with batch norm in train mode (a train-mode capture would move its running statistics): the
    analysis finds the groups and the model keeps its forward, attributes, tensors and their values."""
    torch.manual_seed(0)
    model = ConvTransformer().double().train()
    x = torch.randn(2, 3, 8, 8, dtype=torch.double)
    before = snapshot(model)
    with torch.no_grad():
        y = model.eval()(x)
    model.train()
    analysis = analyse(model, (x,))
    assert [g.name for g in analysis.groups] == ["attns.0:head", "mlps.0:channel", "attns.1:head", "mlps.1:channel"]
    assert all(g.count == g.max_count for g in analysis.groups)
    assert_untouched(model, before)
    with torch.no_grad():
        assert torch.equal(model.eval()(x), y)


@pytest.mark.parametrize("enabled", [True, False])
def test_analyse_leaves_the_garbage_collector_as_it_was(enabled: bool) -> None:
    """The analysis pauses Python's cyclic collector while it runs, and puts it back as the caller had it, also when
    the analysis fails."""
    torch.manual_seed(0)
    model, x = ConvTransformer(), torch.randn(2, 3, 8, 8)
    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        analyse(model, (x,))
        assert gc.isenabled() is enabled
        with pytest.raises(AnalysisError):
            analyse(model, (torch.randn(2, 5),))  # a call the model cannot take
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()


class SelfCopying(nn.Linear):
    """A module that copies itself its own way (the working copy must leave it to ``deepcopy``)."""

    def __deepcopy__(self, memo: dict) -> nn.Module:
        copied = nn.Linear.__new__(SelfCopying)
        memo[id(self)] = copied
        copied.__dict__.update(copy.deepcopy(self.__dict__, memo))
        copied.copied_its_own_way = True
        return copied


def test_the_working_copy_copies_as_deepcopy_does() -> None:
    """Submodules shared by two parents or held as plain attributes stay one module, hooks come along, a module with
    its own ``__deepcopy__`` copies its own way, parameters are new objects over the same storage and buffers are
    cloned; the model is left as it was."""
    shared, own = nn.Linear(4, 4), SelfCopying(4, 4)
    model = nn.Sequential(shared, nn.BatchNorm1d(4), nn.Sequential(shared, own))
    model.__dict__["alias"] = shared  # a plain attribute naming a submodule
    calls = []
    shared.register_forward_hook(lambda *args: calls.append(1))
    working = model_analysis_working_copy(model)
    assert working[0] is working[2][0] is working.__dict__["alias"] and working[0] is not shared
    assert getattr(working[2][1], "copied_its_own_way", False) and not hasattr(own, "copied_its_own_way")
    for original, copied in zip(model.parameters(), working.parameters()):
        assert copied is not original and copied.data_ptr() == original.data_ptr()
    for original, copied in zip(model.buffers(), working.buffers()):
        assert copied is not original and copied.data_ptr() != original.data_ptr() and torch.equal(copied, original)
    working(torch.randn(3, 4))
    assert calls == [1, 1] and working[1].running_mean.abs().sum() > 0 and model[1].running_mean.abs().sum() == 0
    assert working[1]._forward_hooks is not model[1]._forward_hooks


def test_analysis_pickles_copies_and_compares() -> None:
    torch.manual_seed(0)
    model = TinyTransformer(Style(heads=3)).double()
    x = torch.randn(2, 4, 5, dtype=torch.double)
    analysis = analyse(model, (x,))
    assert analysis == analyse(copy.deepcopy(model), (x,))  # the same model, analysed again
    restored = pickle.loads(pickle.dumps(analysis))
    assert isinstance(restored, Analysis) and restored == analysis and restored._plan is None
    assert copy.deepcopy(analysis) == analysis
    assert [(g.name, g.count, g.slices) for g in restored.groups] == [(g.name, g.count, g.slices)
                                                                        for g in analysis.groups]
    assert analysis != analyse(TinyTransformer(Style(heads=2)).double(), (x,))  # other widths
    assert analysis != analyse(copy.deepcopy(model).float(), (x.float(),))  # another dtype of the call


def test_surgeon_installs_an_analysis_without_analysing_again(monkeypatch) -> None:
    """`Surgeon(model, analysis)` installs the plan the analysis made; on a model built alike it operates as a
    Surgeon made from the example call does (a removal equals masking the unit)."""
    torch.manual_seed(0)
    model = TinyTransformer(Style(heads=3)).double().eval()
    original = copy.deepcopy(model)
    x = torch.randn(2, 4, 5, dtype=torch.double)
    analysis = analyse(model, (x,))

    def no_planning(*_):
        raise AssertionError("Surgeon(model, analysis) planned again")

    monkeypatch.setattr(analysis_value, "plan_model", no_planning)
    surgeon = Surgeon(model, analysis)
    assert surgeon.analysis == analysis and surgeon.analysis._plan is None  # the plan goes once installed
    assert [g.name for g in surgeon.groups] == [g.name for g in analysis.groups]
    head = surgeon.group(analysis.groups[0].name)
    surgeon.remove(head, 1)
    assert analysis.groups[0].count == analysis.groups[0].max_count  # the analysis keeps its counts
    out = next(sl for sl in head.slices if sl.output)
    reference = masked_copy(original, {out.name: {1}}, {out.name: out.outer * out.inner})
    with torch.no_grad():
        assert (model(x) - reference(x)).abs().max() <= 1e-9


def test_each_host_is_fingerprinted_once_when_analysed_and_installed_in_one_step(monkeypatch) -> None:
    """`Surgeon(model, example)` installs on ``model`` the hosts its analysis fingerprinted on the copy of ``model``
    it made: none is fingerprinted again. Given an analysis made before, the model's hosts are (it may have changed
    since)."""
    torch.manual_seed(0)
    model = TinyTransformer(Style(heads=3)).eval()
    x = torch.randn(2, 4, 5)
    real, seen = analysis_cache.fingerprint, []
    monkeypatch.setattr(analysis_cache, "fingerprint", lambda module, *call: seen.append(module) or real(module, *call))
    surgeon = Surgeon(model, (x,))
    own = set(map(id, model.modules()))
    assert seen and not any(id(m) in own for m in seen)
    assert len(seen) == len({id(m) for m in seen})  # each host of the copy once
    seen.clear()
    given = Surgeon(model, analyse(model, (x,)))
    assert any(id(m) in own for m in seen)
    assert [g.name for g in given.groups] == [g.name for g in surgeon.groups]


def test_the_analysis_installs_one_host_of_each_kind_on_its_copy_and_the_surgeon_every_host_once(monkeypatch) -> None:
    """`analyse` self-checks the first host of each kind on its working copy (those built alike share the outcomes);
    `Surgeon(model, analysis)` installs every host on the model once, and checks nothing again."""
    torch.manual_seed(0)
    model = TinyTransformer(Style(heads=3, depth=3)).eval()
    x = torch.randn(2, 4, 5)
    real, installed = analysis_install.install_host, []
    monkeypatch.setattr(analysis_install, "install_host", lambda module, *a, **k: installed.append(module)
                        or real(module, *a, **k))
    analysis = analyse(model, (x,))
    kinds = {host.rpartition(".")[2] for host in analysis._plan.checks}
    assert len(installed) == len(kinds) and not set(map(id, installed)) & set(map(id, model.modules()))
    installed.clear()
    monkeypatch.setattr(analysis_install, "self_check", lambda *_: pytest.fail("the Surgeon checked again"))
    surgeon = Surgeon(model, analysis)
    hosts = [model.get_submodule(host) for host in analysis._plan.checks]
    assert [id(m) for m in installed] == [id(m) for m in hosts] and len(hosts) == 3 * len(kinds)
    assert [g.name for g in surgeon.groups] == [g.name for g in analysis.groups]


def test_an_analysis_of_hosts_changed_since_is_made_again_before_it_installs(monkeypatch) -> None:
    """A host whose fingerprint changed after the analysis (a plain attribute set) is not the host checked: the
    Surgeon analyses the model again, and installs that analysis, which must find the same groups."""
    torch.manual_seed(0)
    model = TinyTransformer(Style(heads=3)).eval()
    analysis = analyse(model, (torch.randn(2, 4, 5),))
    model.blocks[0].attn.note = "changed after the analysis"
    real, planned = analysis_value.plan_model, []
    monkeypatch.setattr(analysis_value, "plan_model", lambda *a: planned.append(a) or real(*a))
    surgeon = Surgeon(model, analysis)
    assert len(planned) == 1 and [g.name for g in surgeon.groups] == [g.name for g in analysis.groups]


def test_a_unit_group_is_read_only_and_an_analysis_keeps_its_own() -> None:
    """A group's description is decided before it is built; its Surgeon's edits change only its count (and the
    slices a fused projection moves), on groups of the Surgeon's own."""
    model = TinyTransformer(Style(heads=3)).eval()
    analysis = analyse(model, (torch.randn(2, 4, 5),))
    surgeon = Surgeon(model, analysis)
    head = surgeon.group(analysis.groups[0].name)
    assert head is not analysis.groups[0]
    for name, value in [("count", 1), ("min_count", 1), ("notes", ("x",)), ("slices", ())]:
        with pytest.raises(AttributeError, match="read-only"):
            setattr(head, name, value)
    surgeon.remove(head, 0)
    assert head.count == 2 and analysis.groups[0].count == 3


def test_an_analysis_describes_its_groups_immutably_and_a_surgeon_edits_their_live_state_only() -> None:
    """What the analysis found of a group is a frozen ``GroupDescription``; a Surgeon's edits change its groups' live
    state (the counts, and the segment of a fused projection that moves with the heads before it), never the
    descriptions it shares with the analysis."""
    torch.manual_seed(0)
    model = VisionTransformer(img_size=16, patch_size=8, embed_dim=12, depth=1, num_heads=3, mlp_ratio=2,
                              num_classes=5, class_token=False, global_pool="avg",
                              block_fn=functools.partial(ParallelScalingBlock, fuse_out_proj=True))
    analysis = analyse(model, (torch.randn(2, 3, 16, 16),))
    analysed = copy.deepcopy(analysis.groups)
    assert all(isinstance(d, GroupDescription) and d.count == d.max_count for d in analysis.groups)
    with pytest.raises(dataclasses.FrozenInstanceError):
        analysis.groups[0].max_count = 1
    surgeon = Surgeon(model, analysis)
    heads, channels = surgeon.group("blocks.0:head"), surgeon.group("blocks.0:channel")
    surgeon.remove(heads, 0)
    surgeon.clone(channels, 0)
    assert analysis.groups == analysed
    assert all(g.description is d for g, d in zip(surgeon.groups, analysis.groups))
    assert (heads.count, channels.count) == (2, 25) and (heads.description.count, channels.description.count) == (3, 24)
    assert channels.slices != channels.description.slices  # its segment, after the heads', moved
    assert [g.max_count for g in surgeon.groups] == [d.max_count for d in analysis.groups]


def test_surgeon_refuses_an_analysis_of_another_model() -> None:
    x = torch.randn(2, 4, 5)
    analysis = analyse(TinyTransformer(Style(heads=3)), (x,))
    with pytest.raises(ValueError, match=r"another model than this TinyTransformer: module blocks\.0\.attn\.qkv"):
        Surgeon(TinyTransformer(Style(heads=2)), analysis)
    with pytest.raises(ValueError, match="an Analysis or an example call, not both"):
        Surgeon(TinyTransformer(Style(heads=3)), analysis, {"mask": None})


def test_an_unpickled_analysis_installs_after_analysing_again() -> None:
    torch.manual_seed(0)
    model = TinyTransformer(Style(heads=3)).double()
    x = torch.randn(2, 4, 5, dtype=torch.double)
    restored = pickle.loads(pickle.dumps(analyse(model, (x,))))
    surgeon = Surgeon(model, restored)
    assert [g.name for g in surgeon.groups] == [g.name for g in restored.groups]
    surgeon.clone(surgeon.groups[0], 0)
    assert surgeon.groups[0].count == restored.groups[0].count + 1
