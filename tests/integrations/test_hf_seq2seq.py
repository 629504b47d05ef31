"""An encoder-decoder in transformers' `Seq2SeqTrainer` with BarterCallback, evaluated with `predict_with_generate`
every few steps: generation in the middle of training (cached calls between the transfers, while the score taps are
live) leaves the run as it would be without evaluation, and at each evaluation generating with the cache equals
generating without it."""
import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("tokenizers")

import torch  # noqa: E402
from transfer_checks import QUICK_TRANSFERS, ScoreRecorder  # noqa: E402
from transformers import (  # noqa: E402
    DataCollatorForSeq2Seq,
    Seq2SeqTrainer,
    Seq2SeqTrainingArguments,
    T5Config,
    T5ForConditionalGeneration,
    TrainerCallback,
)

from barter.integrations.hf import BarterCallback  # noqa: E402
from tests.integrations.test_hf_models import STEPS, sentences, tokenizer  # noqa: E402


def pairs(n: int) -> list[dict]:
    """Sentences of 4 to 15 ids with their first six ids reversed as the target."""
    items = sentences(n, labels=False)
    for item in items:
        item["labels"] = list(reversed(item["input_ids"][:6]))
    return items


class CachedEqualsUncached(TrainerCallback):
    """At each evaluation: whether greedy generation with the cache equals generation without it, and leaves the
    random number generator as it was (the calls a layer's graphs do not serve yet are served without drawing)."""

    def __init__(self, batch: dict) -> None:
        self.batch = batch
        self.equal: list[bool] = []

    def on_evaluate(self, args, state, control, model=None, **kwargs):
        options = dict(attention_mask=self.batch["attention_mask"], max_new_tokens=6, do_sample=False)
        state = torch.get_rng_state()
        with torch.no_grad():
            cached = model.generate(self.batch["input_ids"], use_cache=True, **options)
            uncached = model.generate(self.batch["input_ids"], use_cache=False, **options)
        self.equal.append(torch.equal(cached, uncached) and torch.equal(state, torch.get_rng_state()))


def run(tmp_path, *, evaluate: bool):
    """STEPS steps of a tiny T5 without dropout (the Trainer's evaluation draws from the random number generator,
    each DataLoader iteration its base seed, which would change the later dropout masks, with or without barter)."""
    torch.manual_seed(0)
    model = T5ForConditionalGeneration(T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                                num_decoder_layers=2, num_heads=4, decoder_start_token_id=0,
                                                pad_token_id=0, eos_token_id=1, dropout_rate=0.0))
    collator = DataCollatorForSeq2Seq(tokenizer(), model=model)
    barter_callback = BarterCallback(**QUICK_TRANSFERS)
    checks = [ScoreRecorder(barter_callback), CachedEqualsUncached(collator(pairs(4)))]
    evaluation = {"eval_strategy": "steps", "eval_steps": 3, "predict_with_generate": True,
                  "generation_max_length": 8} if evaluate else {}
    args = Seq2SeqTrainingArguments(output_dir=str(tmp_path), max_steps=STEPS, per_device_train_batch_size=4,
                                    per_device_eval_batch_size=4, learning_rate=1e-3, report_to=[], use_cpu=True,
                                    logging_strategy="no", disable_tqdm=True, seed=0, save_strategy="no",
                                    **evaluation)
    trainer = Seq2SeqTrainer(model=model, args=args, train_dataset=pairs(32), eval_dataset=pairs(8),
                             data_collator=collator, callbacks=[barter_callback, *checks])
    trainer.train()
    return barter_callback.controller, model, checks, trainer


def test_generating_between_transfers_leaves_the_run_and_the_cache_serves_it(tmp_path):
    plain, plain_model, _, _ = run(tmp_path / "plain", evaluate=False)
    evaluated, model, (recorder, generation), trainer = run(tmp_path / "evaluated", evaluate=True)
    assert recorder.nonzero and all(recorder.nonzero)
    steps = [e.step for e in evaluated.events if e.skipped is None]
    assert len(generation.equal) == STEPS // 3 and all(generation.equal)  # evaluations between the transfers
    assert steps and min(steps) < 3 * len(generation.equal) - 3 < max(steps)
    assert evaluated.events == plain.events
    for (name, a), b in zip(plain_model.state_dict().items(), model.state_dict().values()):
        torch.testing.assert_close(a, b, msg=name)
    predictions = trainer.predict(pairs(4)).predictions
    assert predictions.shape[0] == 4
