"""barter.export / barter.load: round trips of compact timm, project and hand-written models (outputs, parameter
counts, further training), models barter did not resize, and clear errors for corrupt or mismatched files."""
import collections
import copy
import gc
import json
import pickle
import weakref

import pytest
import torch
from zoo import Style, TinyTransformer

import barter
from barter import ExportError
from barter.rebuild import timm_with_models
from barter.serialization import write_manifest
from fxsurgery import GroupDescription, Surgeon

VIT = ("vit_tiny_patch16_224", {"img_size": 32, "patch_size": 8, "depth": 2, "num_classes": 10})
CCT = ("cct_2_3x1_32_tiny", {})


def parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def transferred(model: torch.nn.Module, x: torch.Tensor, **wrap_options) -> barter.Controller:
    """Wrap `model` at density 0.5 and train 6 steps with a random transfer after each."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ctl = barter.wrap(model, optimizer, total_steps=6, density=0.5, method="random_pair", window=(0.0, 1.0),
                      **wrap_options)
    for _ in range(6):
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    assert any(e["skipped"] is None for e in ctl.events)
    return ctl


def compact_timm(name: str, kwargs: dict) -> tuple[torch.nn.Module, barter.Controller, int]:
    torch.manual_seed(0)
    model = timm_with_models().create_model(name, **kwargs)
    dense = parameters(model)
    return model, transferred(model, torch.randn(4, 3, 32, 32)), dense


def read_topology(path) -> dict:
    return json.loads((path / "topology.json").read_text())


def assert_same_outputs(a: torch.nn.Module, b: torch.nn.Module, x: torch.Tensor) -> None:
    """Bit-identical in eval mode, and in train mode under the same seed (dropout, drop path)."""
    with torch.no_grad():
        a.eval(), b.eval()
        assert torch.equal(a(x), b(x))
        a.train(), b.train()
        torch.manual_seed(1)
        ya = a(x)
        torch.manual_seed(1)
        assert torch.equal(ya, b(x))


def test_the_export_writes_each_group_s_own_description(tmp_path):
    """topology.json holds each group's own serialisation (`GroupDescription.to_dict`) with the count it keeps: read
    back, it is the description as analysed."""
    model, ctl, _ = compact_timm(*VIT)
    topology = read_topology(barter.export(model, tmp_path / "model"))
    assert [GroupDescription.from_dict(g) for g in topology["groups"]] == list(ctl.surgeon.analysis.groups)
    assert [g["count"] for g in topology["groups"]] == [g.count for g in ctl.surgeon.groups]
    assert any(g.count < g.max_count for g in ctl.surgeon.groups)

@pytest.mark.parametrize("name,kwargs", [VIT, CCT], ids=["vit", "cct"])
def test_round_trip_after_transfers(tmp_path, name, kwargs):
    model, ctl, dense = compact_timm(name, kwargs)
    path = barter.export(model, tmp_path / "model")
    topology = read_topology(path)
    assert topology["architecture"] == name and topology["model_kwargs"] == kwargs  # read off the model
    assert {g["name"]: (g["count"], g["max_count"]) for g in topology["groups"]} == {
        g.name: (g.count, g.max_count) for g in ctl.surgeon.groups}
    loaded = barter.load(path)
    assert type(loaded) is type(model)
    assert parameters(loaded) == parameters(model) == topology["parameters"] < dense
    for key, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], tensor), key
    assert_same_outputs(model, loaded, torch.randn(3, 3, 32, 32))
    assert read_topology(barter.export(loaded, tmp_path / "again")) == topology  # same bytes, same topology
    optimizer = torch.optim.AdamW(loaded.parameters(), lr=1e-2)
    before = copy.deepcopy(loaded.state_dict())
    loaded(torch.randn(2, 3, 32, 32)).logsumexp(1).mean().backward()
    optimizer.step()
    assert all(not torch.equal(before[k], v) for k, v in loaded.state_dict().items() if k.endswith("fc1.weight"))


@pytest.mark.parametrize("name,kwargs", [
    ("vit_tiny_patch16_224", {"img_size": 32, "patch_size": 8, "depth": 3}),
    ("vit_tiny_patch16_224", {"img_size": 32, "patch_size": 8, "depth": 2, "embed_dim": 64, "num_heads": 4,
                              "mlp_ratio": 2.0, "class_token": False, "global_pool": "avg", "reg_tokens": 2,
                              "qkv_bias": False, "num_classes": 7}),
    ("deit3_small_patch16_224", {"img_size": 32, "patch_size": 8, "depth": 1, "embed_dim": 96, "num_heads": 2}),
    ("eva02_tiny_patch14_224", {"img_size": 28, "depth": 1, "embed_dim": 64, "num_heads": 2}),
    ("beit_base_patch16_224", {"img_size": 32, "patch_size": 8, "depth": 1, "embed_dim": 64, "num_heads": 2}),
    ("swin_tiny_patch4_window7_224", {"img_size": 56, "depths": [1, 1, 2, 1], "embed_dim": 32,
                                      "num_heads": [1, 2, 4, 8]}),
], ids=["vit-issue", "vit-everything", "deit3", "eva02", "beit", "swin"])
def test_overrides_are_read_back_off_the_model(tmp_path, name, kwargs):
    """timm keeps the registered config of a model built with overrides; the export reads them off the model,
    compact after transfers or dense, and `barter.load` rebuilds it without being told anything."""
    torch.manual_seed(0)
    model = timm_with_models().create_model(name, **kwargs)
    size = kwargs["img_size"]
    if name.startswith("vit"):
        transferred(model, torch.randn(4, 3, size, size))
    path = barter.export(model, tmp_path / "model", program=False)
    assert read_topology(path)["model_kwargs"] == kwargs
    assert_same_outputs(model, barter.load(path), torch.randn(2, 3, size, size))


def test_an_export_that_would_not_reload_is_refused(tmp_path):
    """Arguments that cannot be read off the model (LayerScale's init_values) make the export fail, naming what
    to pass; passing it exports a directory that loads. Nothing is left at the refused path."""
    model = timm_with_models().create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2,
                                            init_values=1e-5)
    with pytest.raises(ExportError, match=r"does not rebuild this model \(keys only the model has: \['blocks\.0\.ls1"
                                          r".*pass .*model_kwargs="):
        barter.export(model, tmp_path / "model")
    assert not (tmp_path / "model").exists()
    path = barter.export(model, tmp_path / "model", model_kwargs={"init_values": 1e-5}, program=False)
    assert_same_outputs(model, barter.load(path), torch.randn(2, 3, 32, 32))
    with pytest.raises(ExportError, match=r"shapes: \[.*'patch_embed\.proj\.weight is \[192, 3, 8, 8\] in the model, "
                                          r"\[192, 3, 16, 16\]"):
        barter.export(model, tmp_path / "other", architecture="vit_tiny_patch16_224",
                      model_kwargs={"img_size": 32, "depth": 2, "init_values": 1e-5})


@pytest.mark.parametrize("name,kwargs", [VIT, CCT], ids=["vit", "cct"])
def test_program_loads_with_plain_torch(tmp_path, name, kwargs):
    """model.pt2, a torch.export program of the compact model in eval mode, gives the live model's outputs at
    any batch size, loaded with torch alone."""
    model, _, _ = compact_timm(name, kwargs)
    path = barter.export(model, tmp_path / "model")
    assert model.training and read_topology(path)["program"] == "model.pt2"  # the live model is left in train mode
    program = torch.export.load(path / "model.pt2").module()
    model.eval()
    with torch.no_grad():
        for batch in (1, 2, 5):
            x = torch.randn(batch, 3, 32, 32)
            assert torch.equal(program(x), model(x))


def test_loaded_model_can_be_wrapped_again_and_reexported(tmp_path):
    model, _, _ = compact_timm(*VIT)
    loaded = barter.load(barter.export(model, tmp_path / "model"))
    assert Surgeon(copy.deepcopy(loaded), (torch.zeros(2, 3, 32, 32),)).groups  # a fresh analysis works
    ctl = transferred(loaded, torch.randn(4, 3, 32, 32))  # shrinks it further, moves units
    again = barter.load(barter.export(loaded, tmp_path / "again"))
    assert parameters(again) == parameters(loaded) < parameters(model)
    assert_same_outputs(loaded, again, torch.randn(3, 3, 32, 32))
    counts = {g["name"]: g["count"] for g in read_topology(tmp_path / "again")["groups"]}
    assert all(counts[g.name] == g.count for g in ctl.surgeon.groups)


def test_model_barter_did_not_resize(tmp_path):
    """A copy of a compact model (no recorded analysis): the base is analysed and the counts read off the
    tensors; a dense model exports every group at its maximum."""
    model, ctl, _ = compact_timm(*CCT)
    copied = copy.deepcopy(model)
    del copied.barter_base  # what barter knows of the model's base
    loaded = barter.load(barter.export(copied, tmp_path / "copy"))
    assert read_topology(tmp_path / "copy")["groups"] == read_topology(barter.export(model, tmp_path / "model"))[
        "groups"]
    assert_same_outputs(copied, loaded, torch.randn(3, 3, 32, 32))
    dense = timm_with_models().create_model(CCT[0], num_classes=5)
    groups = read_topology(barter.export(dense, tmp_path / "dense"))["groups"]
    assert groups and all(g["count"] == g["max_count"] for g in groups)
    assert read_topology(tmp_path / "dense")["model_kwargs"] == {"num_classes": 5}
    assert_same_outputs(dense, barter.load(tmp_path / "dense"), torch.randn(3, 3, 32, 32))


def test_half_precision_comes_back_in_half_precision(tmp_path):
    model, _, _ = compact_timm(*CCT)
    model.to(torch.bfloat16)
    copied = copy.deepcopy(model)
    del copied.barter_base  # no recorded analysis: the single-precision base is analysed
    for source, name in ((model, "model"), (copied, "copy")):
        loaded = barter.load(barter.export(source, tmp_path / name))
        assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}
        assert_same_outputs(source, loaded, torch.randn(3, 3, 32, 32, dtype=torch.bfloat16))


def program_ops(path) -> collections.Counter:
    return collections.Counter(str(node.target) for node in torch.export.load(path / "model.pt2").graph.nodes
                               if node.op == "call_function")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def test_half_precision_program(tmp_path, dtype):
    """A model analysed in single precision and cast to half meets its half-precision call first inside
    torch.export: model.pt2 is written all the same, gives the eager compact model's outputs at any batch size,
    and runs the single-precision program's ops (none of the analysis that served the new call)."""
    model, _, _ = compact_timm(*CCT)
    single = barter.export(model, tmp_path / "single")
    model.to(dtype)
    path = barter.export(model, tmp_path / "half")
    assert read_topology(path)["program"] == "model.pt2"
    program = torch.export.load(path / "model.pt2").module()
    model.eval()
    with torch.no_grad():
        for batch in (1, 2, 5):
            x = torch.randn(batch, 3, 32, 32, dtype=dtype)
            expected = model(x)
            assert expected.dtype == dtype
            torch.testing.assert_close(program(x), expected)
    assert program_ops(path) == program_ops(single)


def test_hand_written_model_loads_into_a_fresh_instance(tmp_path):
    style = Style(heads=4, mlp_hidden=8)
    torch.manual_seed(0)
    model = TinyTransformer(style)
    dense = parameters(model)
    x = torch.randn(4, 6, 5)
    transferred(model, x, example_inputs=(x,))
    path = barter.export(model, tmp_path / "model")
    assert read_topology(path)["architecture"] is None
    with pytest.raises(ExportError, match="records no base architecture"):
        barter.load(path)
    fresh = TinyTransformer(style)
    loaded = barter.load(path, model=fresh)
    assert loaded is fresh and parameters(loaded) == parameters(model) < dense
    assert_same_outputs(model, loaded, torch.randn(3, 6, 5))


def test_model_without_unit_groups_is_exported_as_it_is(tmp_path):
    model = torch.nn.Linear(5, 3)
    with pytest.warns(UserWarning, match="exported without unit groups"):
        path = barter.export(model, tmp_path / "model", example_inputs=(torch.zeros(2, 5),))
    assert read_topology(path)["groups"] == []
    loaded = barter.load(path, model=torch.nn.Linear(5, 3))
    assert torch.equal(loaded.weight, model.weight) and torch.equal(loaded.bias, model.bias)


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_corrupt_weights_fail_the_checksum(tmp_path, damage):
    model, _, _ = compact_timm(*CCT)
    weights = barter.export(model, tmp_path / "model") / "model.safetensors"
    data = bytearray(weights.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0xFF
    else:
        del data[-100:]
    weights.write_bytes(bytes(data))
    with pytest.raises(ExportError, match="model.safetensors: checksum mismatch"):
        barter.load(tmp_path / "model")


def test_missing_or_foreign_files(tmp_path):
    with pytest.raises(ExportError, match="no barter export"):
        barter.load(tmp_path)
    (tmp_path / "topology.json").write_text("{not json")
    with pytest.raises(ExportError, match="manifest.json is missing"):
        barter.load(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"")
    write_manifest(tmp_path)  # files written so, not damaged
    with pytest.raises(ExportError, match="not valid JSON"):
        barter.load(tmp_path)
    (tmp_path / "topology.json").write_text(json.dumps({"format": "barter-export", "version": 99}))
    write_manifest(tmp_path)
    with pytest.raises(ExportError, match="format version 99"):
        barter.load(tmp_path)
    (tmp_path / "other.txt").write_text("keep me")
    model, _, _ = compact_timm(*CCT)
    (tmp_path / "topology.json").unlink()
    with pytest.raises(ExportError, match="not a barter export; refusing"):
        barter.export(model, tmp_path)
    assert (tmp_path / "other.txt").read_text() == "keep me"


def test_mismatched_topology_or_model_leaves_the_model_unchanged(tmp_path):
    model, _, _ = compact_timm(*CCT)
    path = barter.export(model, tmp_path / "model")
    topology = read_topology(path)
    channel = next(g for g in topology["groups"] if g["kind"] == "channel")
    channel["count"] -= 1  # the weights no longer fit the recorded topology
    (path / "topology.json").write_text(json.dumps(topology))
    write_manifest(path)  # a topology written so, not damaged
    fresh = timm_with_models().create_model(CCT[0])
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(ExportError, match=r"does not fit CCT .*shapes: .*mlp\.fc1\.weight is \["):
        barter.load(path, model=fresh)
    assert fresh.state_dict().keys() == before.keys()
    assert all(torch.equal(v, before[k]) for k, v in fresh.state_dict().items())
    deeper = timm_with_models().create_model(CCT[0], depth=3)
    with pytest.raises(ExportError, match=r"missing keys: \['blocks\.2\."):
        barter.load(barter.export(model, tmp_path / "model"), model=deeper)
    with pytest.raises(ExportError, match="no unit group 'blocks.1.attn:head'"):
        barter.load(tmp_path / "model", model=timm_with_models().create_model(CCT[0], depth=1))


def test_recorded_analyses_do_not_keep_models_alive(tmp_path):
    model, ctl, _ = compact_timm(*CCT)
    loaded = barter.load(barter.export(model, tmp_path / "model"))
    refs = [weakref.ref(model), weakref.ref(loaded)]
    del model, ctl, loaded
    gc.collect()
    assert all(ref() is None for ref in refs)


def test_the_base_travels_with_the_model(tmp_path, monkeypatch):
    """`model.barter_base` is an attribute: a model made by `wrap` or `load`, a deep copy of either and a pickle
    round trip of either export the same topology, each without analysing the model again."""
    model, ctl, _ = compact_timm(*VIT)
    ctl.close()
    loaded = barter.load(barter.export(model, tmp_path / "model"))
    expected = read_topology(tmp_path / "model")
    assert loaded.barter_base.architecture == VIT[0] and loaded.barter_base.analysis == model.barter_base.analysis
    monkeypatch.setattr(barter.serialization, "analyse", None)  # exporting must not analyse anything
    for label, source in (("wrap", model), ("load", loaded)):
        for way, made in (("deepcopy", copy.deepcopy(source)), ("pickle", pickle.loads(pickle.dumps(source)))):
            assert made.barter_base.analysis == source.barter_base.analysis, (label, way)
            topology = read_topology(barter.export(made, tmp_path / f"{label}-{way}", program=False))
            assert {k: v for k, v in topology.items() if k != "program"} == {
                k: v for k, v in expected.items() if k != "program"}, (label, way)


def test_loading_a_run_directory_says_it_is_a_run_and_points_to_its_checkpoint(tmp_path):
    run = tmp_path / "runs" / "vit"
    model, _, _ = compact_timm(*VIT)
    barter.export(model, run / "best", program=False)
    (run / "config.json").write_text("{}")
    with pytest.raises(ExportError, match=rf"is a training run.*{run / 'best'}.*barter export {run} OUT"):
        barter.load(run)
    assert parameters(barter.load(run / "best")) == parameters(model)
