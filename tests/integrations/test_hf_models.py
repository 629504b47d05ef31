"""BarterCallback on Hugging Face models in a real transformers.Trainer on CPU, with no example inputs given: the
callback analyses each model on the Trainer's first batch (keyword arguments, labels included), the transfers run
on non-zero scores, and the trained compact model evaluates, predicts and (a causal LM) generates."""
import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("tokenizers")

import torch  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402
from tokenizers.models import WordLevel  # noqa: E402
from transfer_checks import QUICK_TRANSFERS, ScoreRecorder  # noqa: E402
from transformers import (  # noqa: E402
    BertConfig,
    BertForSequenceClassification,
    DataCollatorForLanguageModeling,
    DataCollatorWithPadding,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Trainer,
    TrainingArguments,
    ViTConfig,
    ViTForImageClassification,
)

from barter.integrations.hf import STATE_FILE, BarterCallback  # noqa: E402
from barter.packed_state import pack_state  # noqa: E402

STEPS = 12
VOCAB = 64
TINY = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64}


def tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over VOCAB made-up words, for its padding."""
    vocab = {"[PAD]": 0, "[UNK]": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="[UNK]")),
                                   pad_token="[PAD]", unk_token="[UNK]")


def sentences(n: int = 32, labels: bool = True) -> list[dict]:
    """Token id lists of lengths 4 to 15, so padded batches differ in length, with class labels."""
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(4, 16, (n,), generator=generator)
    items = [{"input_ids": torch.randint(2, VOCAB, (int(length),), generator=generator).tolist()} for length in lengths]
    if labels:
        for i, item in enumerate(items):
            item["labels"] = i % 2
    return items


def images(n: int = 32) -> list[dict]:
    generator = torch.Generator().manual_seed(0)
    return [{"pixel_values": torch.randn(3, 16, 16, generator=generator), "labels": i % 3} for i in range(n)]


def vit(dropout: float = 0.0) -> ViTForImageClassification:
    torch.manual_seed(0)
    return ViTForImageClassification(ViTConfig(image_size=16, patch_size=4, num_labels=3, hidden_dropout_prob=dropout,
                                               **TINY))


def bert() -> BertForSequenceClassification:
    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(vocab_size=VOCAB, max_position_embeddings=32, num_labels=2,
                                                    **TINY))


def train(model, data, tmp_path, *, collator=None, save_steps=None, resume_from=None, trainer_args=None, **options):
    """STEPS Trainer steps with BarterCallback(**QUICK_TRANSFERS, **options), no example inputs unless among `options`,
    saving every `save_steps`, with more TrainingArguments in `trainer_args`; returns (callback, trainer)."""
    barter_callback = BarterCallback(resume_from=resume_from, **QUICK_TRANSFERS, **options)
    saving = {"save_strategy": "no"} if save_steps is None else {"save_strategy": "steps", "save_steps": save_steps}
    recorder = ScoreRecorder(barter_callback)
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=STEPS, per_device_train_batch_size=4,
                             per_device_eval_batch_size=4, learning_rate=1e-3, report_to=[], use_cpu=True,
                             logging_strategy="no", disable_tqdm=True, seed=0, **saving, **(trainer_args or {}))
    trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=collator,
                      callbacks=[barter_callback, recorder])
    trainer.train(resume_from_checkpoint=None if resume_from is None else str(resume_from))
    ctl = barter_callback.controller
    assert set(ctl.surgeon.example_kwargs) >= {"labels"}  # analysed on the Trainer's batch, labels included
    assert ctl.step_count == trainer.state.global_step == STEPS
    assert any(e["skipped"] is None for e in ctl.events)
    assert recorder.nonzero and all(recorder.nonzero)  # every transfer was chosen on non-zero scores
    for kind in ("head", "channel"):
        assert sum(g.count for g in ctl.layers[kind]) == sum(ctl.initial[kind])
    return barter_callback, trainer


def test_vit_image_classification(tmp_path):
    model = vit()
    dense = sum(p.numel() for p in model.parameters())
    barter_callback, trainer = train(model, images(), tmp_path)
    assert set(barter_callback.controller.surgeon.example_kwargs) == {"pixel_values", "labels"}
    assert sum(p.numel() for p in model.parameters()) < dense
    assert "eval_loss" in trainer.evaluate(eval_dataset=images(8))
    assert trainer.predict(images(8)).predictions.shape == (8, 3)


def test_taking_the_first_batch_leaves_the_run_as_it_was(tmp_path):
    """The same run given that batch as example_kwargs: same transfers, same weights (dropout draws included)."""
    model, given_model = vit(dropout=0.1), vit(dropout=0.1)
    automatic, _ = train(model, images(), tmp_path / "automatic")
    batch = {key: value.clone() for key, value in automatic.example_batch.items()}
    given, _ = train(given_model, images(), tmp_path / "given", example_kwargs=batch)
    assert given.example_batch is None and automatic.controller.events == given.controller.events
    for a, b in zip(model.state_dict().values(), given_model.state_dict().values()):
        torch.testing.assert_close(a, b)


def test_resume_analyses_the_batch_saved_with_the_checkpoint(tmp_path):
    """A resumed run wraps before the Trainer has a dataloader, on the batch saved in barter.pt. (BERT: the
    Trainer of transformers 5.24 resumes a ViT without its layers' weights, saved under their legacy names.)"""
    model, resumed_model = bert(), bert()
    collator = DataCollatorWithPadding(tokenizer())
    full, _ = train(model, sentences(), tmp_path / "full", collator=collator, save_steps=4)
    checkpoint = tmp_path / "full" / "checkpoint-4"
    resumed, _ = train(resumed_model, sentences(), tmp_path / "resumed", collator=collator, save_steps=4,
                       resume_from=checkpoint)
    assert resumed.controller.events == full.controller.events
    for a, b in zip(resumed_model.state_dict().values(), model.state_dict().values()):
        torch.testing.assert_close(a, b)


def test_resume_without_a_saved_batch_asks_for_the_example(tmp_path):
    """A checkpoint without the batch (a run given its example): the Trainer has no dataloader yet to take one from."""
    torch.save(pack_state({"total_steps": STEPS, "controller": {}, "batch": None}), tmp_path / STATE_FILE)
    with pytest.raises(ValueError, match="holds no example batch"):
        train(bert(), sentences(), tmp_path / "resumed", collator=DataCollatorWithPadding(tokenizer()),
              resume_from=tmp_path)


def test_bert_sequence_classification_on_padded_batches(tmp_path):
    model = bert()
    collator = DataCollatorWithPadding(tokenizer())
    barter_callback, trainer = train(model, sentences(), tmp_path, collator=collator)
    assert len({len(batch["input_ids"][0]) for batch in trainer.get_train_dataloader()}) > 1  # padded lengths vary
    assert set(barter_callback.controller.surgeon.example_kwargs) == {"input_ids", "attention_mask", "labels"}
    assert "eval_loss" in trainer.evaluate(eval_dataset=sentences(8))
    assert trainer.predict(sentences(8)).predictions.shape == (8, 2)


CAUSAL_LMS = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, max_position_embeddings=64, num_key_value_heads=2,
                                                  pad_token_id=0, **TINY)),
    "gpt2": lambda: GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                                               n_inner=64, bos_token_id=1, eos_token_id=1, pad_token_id=0)),
}


@pytest.mark.parametrize("name", sorted(CAUSAL_LMS))
def test_causal_lm_trains_and_generates(tmp_path, name):
    torch.manual_seed(0)
    model = CAUSAL_LMS[name]()
    collator = DataCollatorForLanguageModeling(tokenizer(), mlm=False)
    barter_callback, trainer = train(model, sentences(labels=False), tmp_path, collator=collator)
    assert set(barter_callback.controller.surgeon.example_kwargs) == {"input_ids", "attention_mask", "labels"}
    assert "eval_loss" in trainer.evaluate(eval_dataset=sentences(8, labels=False))
    prompt = torch.tensor([[5, 6, 7, 8]])
    model.eval()
    with torch.no_grad():
        generated = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4, do_sample=False)
    assert generated.shape == (1, 8) and torch.equal(generated[:, :4], prompt)


@pytest.mark.parametrize("reentrant", [True, False])
def test_gradient_checkpointing_recomputes_the_compact_layers_and_changes_nothing(tmp_path, reentrant):
    """The Trainer's activation (gradient) checkpointing: each layer's attention (an installed forward with its score
    taps) runs again in the backward, and the run is the run without it: the same scores, transfers and weights."""
    runs = {}
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = CAUSAL_LMS["llama"]()
        calls = []
        for layer in model.model.layers:
            layer.self_attn.register_forward_pre_hook(lambda *_, calls=calls: calls.append(1))
        extra = {"activation_checkpointing": True,
                 "activation_checkpointing_kwargs": {"use_reentrant": reentrant}} if checkpointing else {}
        barter_callback, _ = train(model, sentences(labels=False), tmp_path / str(checkpointing),
                                   collator=DataCollatorForLanguageModeling(tokenizer(), mlm=False),
                                   trainer_args=extra)
        runs[checkpointing] = (barter_callback.controller, model, len(calls))
    (plain, plain_model, plain_calls), (checkpointed, checkpointed_model, checkpointed_calls) = runs[False], runs[True]
    assert checkpointed_calls == plain_calls + 2 * STEPS  # each layer's attention ran again in each step's backward
    assert checkpointed.events == plain.events
    for kind in ("head", "channel"):
        torch.testing.assert_close(checkpointed.tables[kind].ema, plain.tables[kind].ema)
    for (name, a), b in zip(plain_model.state_dict().items(), checkpointed_model.state_dict().values()):
        torch.testing.assert_close(a, b, msg=name)


@pytest.mark.parametrize("name", sorted(CAUSAL_LMS))
def test_a_saved_compact_model_loads_from_its_folder_with_barter(tmp_path, name):
    """`trainer.save_model` (and a checkpoint folder of the run) holds the compact weights and a config that records
    the call barter analysed the model on: `barter.load` rebuilds the model from the folder alone (its weights sharded
    too), equal on a padded batch and in `generate` (GPT-2's output embedding, tied to its input one, is not in the
    file);
    `from_pretrained` refuses the compact sizes, and a folder saved from a model barter did not wrap is refused
    with the reason."""
    from transformers import AutoModelForCausalLM

    import barter
    from barter.files import ExportError

    torch.manual_seed(0)
    model = CAUSAL_LMS[name]()
    collator = DataCollatorForLanguageModeling(tokenizer(), mlm=False)
    barter_callback, trainer = train(model, sentences(labels=False), tmp_path / "run", collator=collator,
                                     save_steps=STEPS)
    widths = [g.count for kind in ("head", "channel") for g in barter_callback.controller.layers[kind]]
    assert len(set(widths)) > 2  # the transfers left layers of different widths
    trainer.save_model(str(tmp_path / "final"))
    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert len(list((tmp_path / "sharded").glob("model-*.safetensors"))) > 1
    batch = collator(sentences(4, labels=False))
    prompt = torch.tensor([[5, 6, 7, 8]])
    model.eval()
    with torch.no_grad():
        expected = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        tokens = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4, do_sample=False)
    for folder in (tmp_path / "final", tmp_path / "run" / f"checkpoint-{STEPS}", tmp_path / "sharded"):
        loaded = barter.load(folder).eval()
        assert [p.shape for p in loaded.parameters()] == [p.shape for p in model.parameters()]
        with torch.no_grad():
            logits = loaded(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            assert torch.equal(loaded.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4,
                                               do_sample=False), tokens)
        torch.testing.assert_close(logits, expected)
    with pytest.raises(RuntimeError, match="mismatch"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    CAUSAL_LMS[name]().save_pretrained(tmp_path / "dense")
    with pytest.raises(ExportError, match="has no barter_call: it was not saved from a model barter wrapped"):
        barter.load(tmp_path / "dense")


def test_the_trainers_own_torch_compile_trains_as_eager(tmp_path):
    """`TrainingArguments(torch_compile=True)` compiles the model before the callback wraps it: the compiled run of
    GPT-2 makes the transfers and weights of the eager one."""
    torch._dynamo.reset()
    runs = []
    for extra in ({}, {"torch_compile": True, "torch_compile_backend": "eager"}):
        torch.manual_seed(0)
        model = CAUSAL_LMS["gpt2"]()
        barter_callback, trainer = train(model, sentences(labels=False), tmp_path / str(len(runs)),
                                         collator=DataCollatorForLanguageModeling(tokenizer(), mlm=False),
                                         trainer_args=extra)
        runs.append((barter_callback.controller, model, trainer))
    (eager, eager_model, _), (compiled, compiled_model, trainer) = runs
    assert type(trainer.model_wrapped).__name__ == "OptimizedModule"
    assert compiled.events == eager.events
    for (name, a), b in zip(eager_model.state_dict().items(), compiled_model.state_dict().values()):
        torch.testing.assert_close(a, b, msg=name)
