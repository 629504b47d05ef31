"""barter.export / barter.load of Hugging Face transformers models: the class and config are recorded as the base,
so `barter.load(path)` rebuilds a compact ViT, or a text model analysed on token ids passed by keyword, with no
model at hand; an unknown class is a clear error, and transformers is imported only for such an export."""
import copy
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import barter
from barter import ExportError
from barter.serialization import write_manifest

transformers = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[2]


def tiny_vit() -> torch.nn.Module:
    config = transformers.ViTConfig(num_labels=10, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                    intermediate_size=64, image_size=32, patch_size=8)
    return transformers.ViTForImageClassification(config)


def tiny_bert() -> torch.nn.Module:
    config = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, num_labels=3, attn_implementation="eager")
    return transformers.BertForSequenceClassification(config)


def text_batch(batch: int) -> dict[str, torch.Tensor]:
    """Token ids, a padding mask (the first sequence padded) and labels, as a Trainer passes them."""
    mask = torch.ones(batch, 12, dtype=torch.long)
    mask[0, 8:] = 0
    return {"input_ids": torch.randint(0, 100, (batch, 12)), "attention_mask": mask,
            "labels": torch.randint(0, 3, (batch,))}


def train_with_transfers(model: torch.nn.Module, calls: list[tuple[tuple, dict]], **wrap_options
                         ) -> barter.Controller:
    """Wrap `model` at density 0.5 and train a step with AdamW on each call `model(*args, **kwargs)` of `calls`
    (on its loss, given labels), a random transfer after each (auto)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ctl = barter.wrap(model, optimizer, total_steps=len(calls), density=0.5, method="random_pair",
                      window=(0.0, 1.0), **wrap_options)
    for args, kwargs in calls:
        out = model(*args, **kwargs)
        (out.logits.square().mean() if out.loss is None else out.loss).backward()
        optimizer.step()
        optimizer.zero_grad()
    assert any(e["skipped"] is None for e in ctl.events)
    return ctl


def read_topology(path: Path) -> dict:
    return json.loads((path / "topology.json").read_text())


def logits(model: torch.nn.Module, *args, **kwargs) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(*args, **kwargs).logits


@pytest.fixture(scope="module")
def compact_vit(tmp_path_factory) -> tuple[torch.nn.Module, barter.Controller, Path]:
    torch.manual_seed(0)
    model = tiny_vit()
    ctl = train_with_transfers(model, [((torch.randn(4, 3, 32, 32),), {}) for _ in range(4)],
                               example_inputs=(torch.randn(4, 3, 32, 32),))
    return model, ctl, barter.export(model, tmp_path_factory.mktemp("vit") / "model", program=False)


def test_vit_round_trip_after_transfers(compact_vit, tmp_path):
    model, ctl, path = compact_vit
    topology = read_topology(path)
    assert topology["architecture"] == "transformers:ViTForImageClassification"
    assert topology["model_kwargs"]["hidden_size"] == 32 and len(topology["model_kwargs"]["id2label"]) == 10
    assert topology["inputs"] == [{"shape": [4, 3, 32, 32], "dtype": "float32"}] and topology["input_kwargs"] == {}
    assert {g["name"]: (g["count"], g["max_count"]) for g in topology["groups"]} == {
        g.name: (g.count, g.max_count) for g in ctl.surgeon.groups}
    assert any(g["count"] < g["max_count"] for g in topology["groups"])
    loaded = barter.load(path)
    assert type(loaded) is type(model)
    assert sum(p.numel() for p in loaded.parameters()) == topology["parameters"]
    x = torch.randn(4, 3, 32, 32)
    assert torch.allclose(logits(loaded, x), logits(model, x), atol=1e-5)
    assert read_topology(barter.export(loaded, tmp_path / "again", program=False)) == topology


def test_text_model_analysed_on_keywords_round_trip(tmp_path):
    torch.manual_seed(0)
    model = tiny_bert()
    example = text_batch(4)
    ctl = train_with_transfers(model, [((), text_batch(4)) for _ in range(4)], example_kwargs=example)
    path = barter.export(model, tmp_path / "model", program=False)
    topology = read_topology(path)
    assert topology["architecture"] == "transformers:BertForSequenceClassification"
    assert topology["model_kwargs"]["attn_implementation"] == "eager"
    assert topology["inputs"] == [] and topology["input_kwargs"] == {  # token ids, mask and labels with their values
        name: {"shape": list(value.shape), "dtype": "int64", "values": value.flatten().tolist()}
        for name, value in example.items()}
    loaded = barter.load(path)  # analysed on the recorded call
    assert type(loaded) is type(model) and loaded.config._attn_implementation == "eager"
    assert {g["name"]: g["count"] for g in topology["groups"]} == {g.name: g.count for g in ctl.surgeon.groups}
    batch = text_batch(4)  # fresh, shaped as analysed (a call of another shape is analysed anew)
    assert torch.allclose(logits(loaded, **batch), logits(model, **batch), atol=1e-5)
    assert read_topology(barter.export(loaded, tmp_path / "again", program=False)) == topology


def test_dense_model_program_takes_keywords(tmp_path):
    """A model barter did not resize, exported on a keyword call with a flag: its program takes the call by name
    at any batch size, and the loaded model (no analysis needed) exports again on the recorded call."""
    torch.manual_seed(0)
    model = tiny_vit()
    call = {"pixel_values": torch.randn(2, 3, 32, 32), "interpolate_pos_encoding": False}
    path = barter.export(model, tmp_path / "model", example_kwargs=call)
    topology = read_topology(path)
    assert topology["program"] == "model.pt2" and topology["inputs"] == [] and topology["input_kwargs"] == {
        "pixel_values": {"shape": [2, 3, 32, 32], "dtype": "float32"}, "interpolate_pos_encoding": {"value": False}}
    assert topology["groups"] and all(g["count"] == g["max_count"] for g in topology["groups"])
    program = torch.export.load(path / "model.pt2").module()
    for size in (1, 3):
        x = torch.randn(size, 3, 32, 32)
        assert torch.allclose(program(pixel_values=x, interpolate_pos_encoding=False).logits, logits(model, x),
                              atol=1e-5)
    loaded = barter.load(path)
    assert torch.allclose(logits(loaded, **call), logits(model, **call), atol=1e-5)
    assert read_topology(barter.export(loaded, tmp_path / "again")) == topology


def test_export_without_keyword_inputs_is_refused(compact_vit, tmp_path):
    """A topology without `input_kwargs` (the example call's keyword arguments) is refused, naming the key."""
    _, _, exported = compact_vit
    path = shutil.copytree(exported, tmp_path / "model")
    topology = read_topology(path)
    del topology["input_kwargs"]
    (path / "topology.json").write_text(json.dumps(topology))
    write_manifest(path)  # a topology written so, not damaged
    with pytest.raises(ExportError, match="lacks input_kwargs"):
        barter.load(path)


@pytest.mark.parametrize("name", ["NoSuchModelForAnything", "ViTConfig"])
def test_unknown_transformers_class_is_named(compact_vit, tmp_path, name):
    path = shutil.copytree(compact_vit[2], tmp_path / "model")
    topology = read_topology(path)
    topology["architecture"] = f"transformers:{name}"
    (path / "topology.json").write_text(json.dumps(topology))
    write_manifest(path)  # a topology written so, not damaged
    with pytest.raises(ExportError, match=f"transformers .* has no model class '{name}'"):
        barter.load(path)


def test_transformers_is_imported_only_for_its_exports(tmp_path):
    code = ("import sys, torch, barter; from torch import nn; "
            f"barter.export(nn.Linear(3, 2), {str(tmp_path / 'model')!r}, example_inputs=(torch.zeros(2, 3),), "
            "program=False); print('transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, check=True,
                         cwd=ROOT)
    assert out.stdout.strip().splitlines()[-1] == "False"


def tiny_gemma(key_value_heads: int) -> torch.nn.Module:
    """Gemma with 4 query heads of head_dim 16 (not hidden / heads = 8) sharing `key_value_heads` key/value heads."""
    config = transformers.GemmaConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=key_value_heads, head_dim=16, intermediate_size=64,
                                      max_position_embeddings=32)
    return transformers.GemmaForCausalLM(config)


@pytest.mark.parametrize("key_value_heads", [1, 2, 4])
def test_grouped_query_heads_found_again_at_load(tmp_path, key_value_heads):
    """A multi-query (1), grouped-query (2) and multi-head (4) decoder analysed at wrap on token ids and an
    attention mask keeps its head groups at load: the export records the call's ids and mask (an all-zero mask
    would mask every token, and the analysis of the rebuilt model then finds no head), and the reloaded model
    equals the trained one, on padded batches too."""
    torch.manual_seed(0)
    model = tiny_gemma(key_value_heads)
    example = {"input_ids": torch.randint(0, 100, (4, 12)), "attention_mask": torch.ones(4, 12, dtype=torch.long)}
    ctl = train_with_transfers(model, [((), example) for _ in range(3)], example_kwargs=example)
    heads = {g.name: g.count for g in ctl.surgeon.groups if g.kind == "head"}
    assert len(heads) == 2 and any(g.count < g.max_count for g in ctl.surgeon.groups)
    path = barter.export(model, tmp_path / "model", program=False)
    topology = read_topology(path)
    assert topology["input_kwargs"]["attention_mask"]["values"] == [1] * 48
    assert {g["name"]: g["count"] for g in topology["groups"] if g["name"] in heads} == heads
    loaded = barter.load(path)
    assert read_topology(barter.export(loaded, tmp_path / "again", program=False))["groups"] == topology["groups"]
    assert torch.allclose(logits(loaded, **example), logits(model, **example), atol=1e-5)


@pytest.mark.parametrize("key_value_heads", [1, 2, 4])
def test_compact_grouped_query_model_serves_a_padded_call_after_an_unpadded_one(key_value_heads):
    """Analysed on an all-ones mask (transformers then runs the attention without a mask), a compact decoder then
    called with padding takes the other path (key/value heads repeated to the query heads): it must be served at
    the compact width and equal the same model with the removed units' output columns zeroed (init "first" keeps
    each layer's first units). Multi-query (1) too: the repeat of its one key/value head follows the query heads,
    in the graph captured for the padded call and in the attention's own forward, which serves the calls that
    pass a cache (its count attribute is fitted on such a call, the path the analysed call did not take)."""
    torch.manual_seed(0)
    model = tiny_gemma(key_value_heads).eval()
    reference = copy.deepcopy(model)
    example = {"input_ids": torch.randint(0, 100, (4, 12)), "attention_mask": torch.ones(4, 12, dtype=torch.long)}
    ctl = barter.wrap(model, total_steps=4, density=0.5, init="first", example_kwargs=example)
    assert all(g.count < g.max_count for g in ctl.surgeon.groups)
    for g in ctl.surgeon.groups:
        layer = reference.get_submodule(g.name.split(":")[0])
        output = layer.o_proj if g.kind == "head" else layer.down_proj
        output.weight.data[:, g.count * output.in_features // g.max_count:] = 0
    padded = {name: value for name, value in text_batch(4).items() if name != "labels"}
    for batch in (example, padded):
        assert torch.allclose(logits(model, **batch), logits(reference, **batch), atol=1e-5)


@pytest.mark.parametrize("key_value_heads", [1, 2])
def test_grouped_query_model_analysed_on_a_padded_call_is_exact(key_value_heads):
    """Analysed on a padded call (the path that repeats the key/value heads to the query heads by expand and
    reshape), a multi-query (1) or grouped-query (2) decoder has its head groups, exact; compact, it equals the same
    model with the removed units' output columns zeroed on padded and unpadded calls, with and without a cache."""
    torch.manual_seed(0)
    model = tiny_gemma(key_value_heads).eval()
    reference = copy.deepcopy(model)
    padded = {name: value for name, value in text_batch(4).items() if name != "labels"}
    ctl = barter.wrap(model, total_steps=4, density=0.5, init="first", example_kwargs=padded)
    heads = [g for g in ctl.surgeon.groups if g.kind == "head"]
    units = {1: 4, 2: 2}[key_value_heads]  # a query head; a key/value head with its two query heads
    assert len(heads) == 2 and all(g.exact and g.max_count == units for g in heads)
    for g in ctl.surgeon.groups:
        layer = reference.get_submodule(g.name.split(":")[0])
        output = layer.o_proj if g.kind == "head" else layer.down_proj
        output.weight.data[:, g.count * output.in_features // g.max_count:] = 0
    unpadded = {"input_ids": torch.randint(0, 100, (4, 12)), "attention_mask": torch.ones(4, 12, dtype=torch.long)}
    for batch in (padded, unpadded):
        for use_cache in (False, True):
            assert torch.allclose(logits(model, **batch, use_cache=use_cache),
                                  logits(reference, **batch, use_cache=use_cache), atol=1e-5)


def test_encoder_decoder_round_trip_after_transfers(tmp_path):
    """T5, trained with transfers on its self- and cross-attention heads (each a group over a stack's layers),
    exports and loads equal, finding its groups again; the loaded model decodes with its cache as without."""
    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                                   num_heads=4, decoder_start_token_id=0, dropout_rate=0.0)
    model = transformers.T5ForConditionalGeneration(config)
    example = {"input_ids": torch.randint(0, 64, (2, 8)), "labels": torch.randint(0, 64, (2, 8))}
    ctl = train_with_transfers(model, [((), example) for _ in range(3)], example_kwargs=example)
    heads = {g.name: g.count for g in ctl.surgeon.groups if g.kind == "head"}
    assert set(heads) == {"encoder.block:head", "decoder.block:head", "decoder.block:head1"}
    path = barter.export(model, tmp_path / "model", program=False)
    topology = read_topology(path)
    assert topology["architecture"] == "transformers:T5ForConditionalGeneration"
    loaded = barter.load(path)
    assert read_topology(barter.export(loaded, tmp_path / "again", program=False))["groups"] == topology["groups"]
    assert torch.allclose(logits(loaded, **example), logits(model, **example), atol=1e-5)
    with torch.no_grad():
        cached = loaded.generate(example["input_ids"], use_cache=True, max_new_tokens=4, do_sample=False)
        assert torch.equal(cached, loaded.generate(example["input_ids"], use_cache=False, max_new_tokens=4,
                                                   do_sample=False))


@pytest.mark.parametrize("name", ["Beit", "Data2VecVision"])
def test_relative_position_bias_heads_round_trip(name, tmp_path):
    """BEiT / Data2Vec vision with a relative-position bias table per layer (its layers called with the image's
    resolution): the compact model after transfers reloads with the same groups and outputs."""
    config = getattr(transformers, f"{name}Config")(num_labels=2, hidden_size=32, num_hidden_layers=2,
                                                    num_attention_heads=4, intermediate_size=64, image_size=32,
                                                    patch_size=8, use_relative_position_bias=True)
    torch.manual_seed(0)
    model = getattr(transformers, f"{name}ForImageClassification")(config)
    ctl = train_with_transfers(model, [((torch.randn(4, 3, 32, 32),), {}) for _ in range(3)],
                               example_inputs=(torch.randn(4, 3, 32, 32),))
    assert sum(g.kind == "head" for g in ctl.surgeon.groups) == 2
    path = barter.export(model, tmp_path / "model", program=False)
    loaded = barter.load(path)
    x = torch.randn(4, 3, 32, 32)
    assert torch.allclose(logits(loaded, x), logits(model, x), atol=1e-5)
    assert {g["name"]: g["count"] for g in read_topology(path)["groups"]} == {
        g.name: g.count for g in ctl.surgeon.groups}


@pytest.mark.parametrize("alibi", [False, True])
def test_fused_multi_query_heads_found_again_at_load(tmp_path, alibi):
    """Multi-query Falcon's query heads are a segment of its fused projection's rows, beside the one key and value
    head's rows, which no group holds: the export's shape check counts those rows (``ParamSlice.fixed``), and the
    reloaded compact model finds the heads again and equals the trained one (with ALiBi, each layer's kept heads'
    slopes too)."""
    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        return transformers.FalconForCausalLM(transformers.FalconConfig(
            vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, multi_query=True,
            new_decoder_architecture=False, alibi=alibi))
    model = build()
    example = {"input_ids": torch.randint(0, 100, (4, 12))}
    ctl = train_with_transfers(model, [((), example) for _ in range(3)], example_kwargs=example)
    heads = {g.name: g.count for g in ctl.surgeon.groups if g.kind == "head"}
    assert len(heads) == 2 and all(count < 4 for count in heads.values())
    path = barter.export(model, tmp_path / "model", program=False)
    loaded = barter.load(path)
    assert {g.name: g.count for g in loaded.barter_base.analysis.groups if g.kind == "head"} == {
        name: 4 for name in heads}
    assert torch.allclose(logits(loaded, **example), logits(model, **example), atol=1e-5)


@pytest.mark.parametrize("density, kept", [(0.5, [1, 1]), (1.0, [1, 2, 3, 1])])
def test_alibi_model_round_trip_carries_the_heads_each_layer_reads(tmp_path, density, kept):
    """Bloom's layers read their kept heads' ALiBi slopes through index buffers that installing the groups adds: the
    export records which heads each layer kept (after a removal and a clone), and the loaded model reads the same
    slopes and gives the same logits. At the full width no count changed, yet the heads read moved: the load still
    analyses the rebuilt model (it skips that only where the weights hold nothing the installation adds)."""
    torch.manual_seed(0)
    model = transformers.BloomForCausalLM(transformers.BloomConfig(hidden_size=32, n_head=4, n_layer=2,
                                                                   vocab_size=100))
    ids = torch.randint(3, 100, (2, 6))
    ctl = barter.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), total_steps=10, density=density,
                      example_kwargs={"input_ids": ids})
    heads = ctl.surgeon.group("transformer.h.1.self_attention:head")
    ctl.surgeon.remove(heads, 0)
    ctl.surgeon.clone(heads, 0)
    indices = {name: b.tolist() for name, b in model.named_buffers() if "unit_index" in name}
    assert indices["transformer.h.1.self_attention.unit_index_0"] == kept
    loaded = barter.load(barter.export(model, tmp_path / "model", program=False))
    assert {name: b.tolist() for name, b in loaded.named_buffers() if "unit_index" in name} == indices
    assert torch.allclose(logits(loaded, input_ids=ids), logits(model, input_ids=ids), atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_a_captured_model_comes_back_in_the_dtype_it_was_exported_in(tmp_path, dtype):
    """MPT is captured by torch.export, whose graph makes the code's own tensors in the dtypes it was captured with:
    a model exported in double or bfloat16 is analysed again in that dtype at load, and gives the same logits."""
    torch.manual_seed(0)
    model = transformers.MptForCausalLM(transformers.MptConfig(d_model=32, n_heads=4, n_layers=2, vocab_size=100,
                                                               max_seq_len=32, expansion_ratio=2)).to(dtype)
    ids = torch.randint(3, 100, (2, 6))
    ctl = barter.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), total_steps=10, density=0.5,
                      example_kwargs={"input_ids": ids})
    assert "export" in ctl.surgeon.explain()
    loaded = barter.load(barter.export(model, tmp_path / "model", program=False))
    assert {p.dtype for p in loaded.parameters()} == {dtype}
    assert torch.equal(logits(loaded, input_ids=ids), logits(model, input_ids=ids))
