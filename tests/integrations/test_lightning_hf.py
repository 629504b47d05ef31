"""The Lightning BarterCallback on a LightningModule that calls a Hugging Face model with keyword arguments: the
module's `example_input_array`, a dict, is the example call (keyword arguments), and a lightning.Trainer run on
CPU makes transfers chosen on non-zero scores."""
import pytest

pytest.importorskip("lightning")
pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402
from tokenizers.models import WordLevel  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from transfer_checks import QUICK_TRANSFERS  # noqa: E402
from transformers import (  # noqa: E402
    BertConfig,
    BertForSequenceClassification,
    DataCollatorWithPadding,
    PreTrainedTokenizerFast,
)

from barter.integrations.lightning import BarterCallback  # noqa: E402

STEPS = 12
VOCAB = 64


class SentenceClassifier(pl.LightningModule):
    """A tiny BERT classifier, called with keyword arguments as HF models are."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = BertForSequenceClassification(BertConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=32, num_labels=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
        ids = torch.randint(2, VOCAB, (2, 8))
        self.example_input_array = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                                    "labels": torch.tensor([0, 1])}

    def forward(self, input_ids, attention_mask, labels):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, labels=labels)

    def training_step(self, batch, batch_idx):
        return self(**batch).loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self(**batch).loss)

    def predict_step(self, batch, batch_idx):
        return self(**batch).logits

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class ScoreRecorder(pl.Callback):
    """Before every optimizer step (the transfers follow it): whether the scores are non-zero in every layer."""

    def __init__(self, barter_callback: BarterCallback) -> None:
        self.barter_callback = barter_callback
        self.nonzero: list[bool] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        ctl = self.barter_callback.controller
        self.nonzero.append(all(float(d.abs().sum()) > 0 and float(s.abs().sum()) > 0
                                for kind in ("head", "channel") for d, s in ctl.scores(kind).values() if d.numel()))


def loader() -> DataLoader:
    """Sentences of 4 to 15 made-up tokens with labels, padded per batch by the HF collator."""
    vocab = {"[PAD]": 0, "[UNK]": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="[UNK]")),
                                        pad_token="[PAD]", unk_token="[UNK]")
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(4, 16, (32,), generator=generator)
    data = [{"input_ids": torch.randint(2, VOCAB, (int(length),), generator=generator).tolist(), "labels": i % 2}
            for i, length in enumerate(lengths)]
    return DataLoader(data, batch_size=4, collate_fn=DataCollatorWithPadding(tokenizer))


def test_a_keyword_example_input_array_is_the_example_call():
    barter_callback = BarterCallback(**QUICK_TRANSFERS)
    recorder = ScoreRecorder(barter_callback)
    trainer = pl.Trainer(max_steps=STEPS, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, callbacks=[barter_callback, recorder])
    module = SentenceClassifier()
    dense = sum(p.numel() for p in module.parameters())
    trainer.fit(module, loader())
    ctl = barter_callback.controller
    assert ctl.surgeon.example_inputs == () and set(ctl.surgeon.example_kwargs) == {"input_ids", "attention_mask",
                                                                                     "labels"}
    assert ctl.step_count == STEPS
    assert any(e["skipped"] is None for e in ctl.events)
    assert recorder.nonzero and all(recorder.nonzero)  # every transfer was chosen on non-zero scores
    for kind in ("head", "channel"):
        assert sum(g.count for g in ctl.layers[kind]) == sum(ctl.initial[kind])
    assert sum(p.numel() for p in module.parameters()) < dense


def test_validate_predict_and_resume(tmp_path):
    """The compact BERT validates and predicts through the Lightning Trainer; a run resumed from the checkpoint
    of its first epoch (padded batches, keyword calls) makes the same transfers and ends with the same weights."""
    def fit(folder, ckpt_path=None):
        barter_callback = BarterCallback(**QUICK_TRANSFERS)
        saver = pl.callbacks.ModelCheckpoint(dirpath=folder, every_n_epochs=1, save_top_k=-1)
        trainer = pl.Trainer(max_epochs=2, accelerator="cpu", logger=False, enable_progress_bar=False,
                             enable_model_summary=False, callbacks=[barter_callback, saver])
        module = SentenceClassifier()
        trainer.fit(module, loader(), ckpt_path=ckpt_path)
        return barter_callback, trainer, module

    full, trainer, module = fit(tmp_path / "full")
    assert any(e["skipped"] is None and e["step"] > 8 for e in full.controller.events)  # after the checkpoint
    (metrics,) = trainer.validate(module, loader(), verbose=False)
    assert torch.isfinite(torch.tensor(metrics["val_loss"]))
    predictions = trainer.predict(module, loader())
    assert len(predictions) == 8 and all(p.shape == (4, 2) for p in predictions)
    checkpoint = next((tmp_path / "full").glob("epoch=0-*.ckpt"))
    resumed, _, resumed_module = fit(tmp_path / "resumed", ckpt_path=str(checkpoint))
    assert resumed.controller.events == full.controller.events
    for a, b in zip(resumed_module.state_dict().values(), module.state_dict().values()):
        torch.testing.assert_close(a, b)
