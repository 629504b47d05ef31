"""The Hugging Face conformance list under the Trainer its users train with: every model of
models_hugging_face.json trains two epochs through `transformers.Trainer` + `BarterCallback(density=0.5)` with no
example given (the callback analyses the Trainer's first batch, keyword arguments and all), with executed
transfers chosen on non-zero scores, then evaluates; text models see padded batches of varying length. Models
with a head of their own use its loss; feature models (a vision tower, an encoder, a decoder stack) a loss over
every output they make. An entry's `causal_lm` trains that class of the same config as a language model instead,
which then generates; its `seq2seq` trains that encoder-decoder class of the same config on the ids as labels, which
then decodes greedily with its cache as without it. The trained model then exports, and `barter.load` rebuilds it
from the export alone, equal on a padded batch (and, for a language model, generating the same tokens)."""
from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from factories import hugging_face  # noqa: E402
from transfer_checks import QUICK_TRANSFERS, ScoreRecorder  # noqa: E402

import barter  # noqa: E402
from barter.integrations.hf import BarterCallback  # noqa: E402

ENTRIES = json.loads((Path(__file__).parent / "models_hugging_face.json").read_text())
SAMPLES, BATCH, EPOCHS = 24, 4, 2


def build(entry: dict) -> torch.nn.Module:
    torch.manual_seed(0)
    kwargs = dict(entry["kwargs"])
    trained = entry.get("causal_lm", entry.get("seq2seq"))
    if trained:
        kwargs["model"] = trained
    return hugging_face(**kwargs)


def samples(entry: dict, n: int) -> list[dict]:
    """Images with class labels, or token ids of lengths 4 to the list's length (labels: a class, or the ids)."""
    generator = torch.Generator().manual_seed(n)
    if "tokens" not in entry:
        return [{"pixel_values": torch.randn(*entry["input"], generator=generator), "labels": i % 2}
                for i in range(n)]
    lengths = torch.randint(4, entry["input"][0] + 1, (n,), generator=generator)
    return [{"input_ids": torch.randint(1, entry["tokens"], (int(k),), generator=generator), "labels": i % 2}
            for i, k in enumerate(lengths)]


def collate(ids_as_labels: bool):
    """Stack images; pad token ids with 0 on the right, with an attention mask (and, for a language model or an
    encoder-decoder, the ids as labels with the padding ignored). The Trainer drops the labels of a model whose
    forward takes none."""
    def batch(items: list[dict]) -> dict:
        labels = {"labels": torch.tensor([i["labels"] for i in items])} if "labels" in items[0] else {}
        if "pixel_values" in items[0]:
            return {"pixel_values": torch.stack([i["pixel_values"] for i in items]), **labels}
        length = max(len(i["input_ids"]) for i in items)
        ids = torch.zeros(len(items), length, dtype=torch.long)
        mask = torch.zeros(len(items), length, dtype=torch.long)
        for row, item in enumerate(items):
            ids[row, :len(item["input_ids"])] = item["input_ids"]
            mask[row, :len(item["input_ids"])] = 1
        if ids_as_labels:
            labels = {"labels": ids.masked_fill(mask == 0, -100)}
        return {"input_ids": ids, "attention_mask": mask, **labels}
    return batch


def feature_loss(outputs, labels=None, num_items_in_batch=None) -> torch.Tensor:
    """A feature model's loss: the mean square of every floating-point output (hidden states, pooled output)."""
    tensors = [t for t in outputs.values() if torch.is_tensor(t) and t.is_floating_point()]
    return sum(t.square().mean() for t in tensors)


def assert_same_outputs(loaded: torch.nn.Module, model: torch.nn.Module, batch: dict, parameters) -> None:
    """Every floating-point output of ``loaded`` (its loss too, given labels) equals the trained ``model``'s on
    ``batch``, in eval mode."""
    batch = {name: value for name, value in batch.items() if name in parameters}
    with torch.no_grad():
        expected, actual = model.eval()(**batch), loaded.eval()(**batch)
    compared = [name for name, value in expected.items() if torch.is_tensor(value) and value.is_floating_point()]
    assert compared
    for name in compared:
        assert torch.allclose(actual[name], expected[name], atol=1e-5), name


@pytest.mark.parametrize("entry", ENTRIES, ids=[e["model"] for e in ENTRIES])
def test_trains_through_the_trainer(entry: dict, tmp_path: Path) -> None:
    model = build(entry)
    parameters = inspect.signature(model.forward).parameters
    own_loss = "labels" in parameters
    callback = BarterCallback(**QUICK_TRANSFERS)
    recorder = ScoreRecorder(callback)
    args = transformers.TrainingArguments(output_dir=str(tmp_path), num_train_epochs=EPOCHS,
                                          per_device_train_batch_size=BATCH, per_device_eval_batch_size=BATCH,
                                          learning_rate=1e-3, report_to=[], use_cpu=True, save_strategy="no",
                                          logging_strategy="no", disable_tqdm=True, seed=0)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=samples(entry, SAMPLES),
                                   eval_dataset=samples(entry, BATCH * 2),
                                   data_collator=collate("causal_lm" in entry or "seq2seq" in entry),
                                   compute_loss_func=None if own_loss else feature_loss,
                                   callbacks=[callback, recorder])
    trainer.train()
    ctl = callback.controller
    assert ctl.step_count == trainer.state.global_step == EPOCHS * SAMPLES // BATCH
    assert set(ctl.surgeon.example_kwargs) <= set(parameters)  # the call the Trainer makes, as it makes it
    assert any(e["skipped"] is None for e in ctl.events), ctl.events
    assert recorder.nonzero and all(recorder.nonzero)  # every transfer chosen on non-zero scores
    for kind in ("head", "channel"):
        assert sum(g.count for g in ctl.layers[kind]) == sum(ctl.initial[kind])  # budgets conserved
    metrics = trainer.evaluate()
    assert all(torch.isfinite(torch.tensor(v)) for k, v in metrics.items() if k == "eval_loss")
    loaded = barter.load(barter.export(model, tmp_path / "export", program=False))
    batch = collate("causal_lm" in entry or "seq2seq" in entry)(samples(entry, BATCH))
    assert_same_outputs(loaded, model, batch, parameters)
    if "causal_lm" in entry:
        prompt = torch.tensor([[5, 6, 7, 8]])
        options = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=4, do_sample=False, pad_token_id=0)
        with torch.no_grad():
            generated = model.eval().generate(prompt, **options)
            assert torch.equal(loaded.eval().generate(prompt, **options), generated)
        assert generated.shape == (1, 8) and torch.equal(generated[:, :4], prompt)
    if "seq2seq" in entry:
        model.eval()
        prompt = torch.tensor([[5, 6, 7, 8, 9], [3, 4, 5, 0, 0]])
        options = dict(attention_mask=(prompt > 0).long(), max_new_tokens=4, do_sample=False)
        with torch.no_grad():
            cached = model.generate(prompt, use_cache=True, **options)
            assert torch.equal(cached, model.generate(prompt, use_cache=False, **options))
