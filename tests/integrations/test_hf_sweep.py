"""benchmarks/hf_sweep.py on a fixed slice of transformers' zoo: each class is built tiny from its config's defaults
and analysed on the Trainer's keyword call, and finds groups or refuses with a reason, never a raw exception (the
whole zoo runs in `make soak`)."""

import pytest
from benchmark_scripts import load_benchmark

pytest.importorskip("transformers")

SLOW = pytest.mark.slow  # 20 s and more each on 2 loaded cores: in `make soak` with the rest of the zoo
SLICE = (  # the fastest of each kind: encoders (shared layers, a Fourier mixer, a captured one), decoders that return
    # a cache (ALiBi, rotary, a mixture of experts), an encoder-decoder, vision transformers, convolutional nets, and
    # a refusal (a forward torch.fx cannot patch)
    "AlbertForMaskedLM", "DistilBertForMaskedLM", "FNetForMaskedLM", "DebertaV2ForSequenceClassification",
    "CamembertForSequenceClassification", "ElectraForCausalLM", "ErnieForCausalLM", "CpmAntForCausalLM",
    "GPT2ForSequenceClassification", "BloomForCausalLM", "LlamaForCausalLM", "MixtralForCausalLM",
    "T5ForConditionalGeneration", "ViTForImageClassification", "BeitForImageClassification",
    "DeiTForImageClassification", "Dinov2WithRegistersForImageClassification", "CLIPForImageClassification",
    "ConvNextForImageClassification", "FalconForCausalLM",
    *(pytest.param(name, marks=SLOW) for name in (
        "BertForSequenceClassification", "MistralForCausalLM", "GemmaForCausalLM", "RobertaForMaskedLM",
        "DistilBertForSequenceClassification", "BioGptForCausalLM", "Qwen2ForCausalLM", "Swinv2ForImageClassification",
        "BartForConditionalGeneration", "BartForSequenceClassification", "MobileViTForImageClassification",
        "Ernie4_5_MoeForCausalLM", "ErgoForCausalLM")),
)


@pytest.fixture(scope="module")
def sweep():
    with pytest.MonkeyPatch.context() as monkeypatch:
        yield load_benchmark("hf_sweep", monkeypatch)


@pytest.mark.parametrize("name", SLICE)
def test_class_finds_groups_or_refuses_with_a_reason(sweep, name):
    row = sweep.sweep_one(name)
    assert row.built, row.why
    assert row.outcome not in sweep.FAILURES, f"{row.outcome.value}: {row.why}\n{row.trace}"
    assert not row.unforeseen, f"a part left out by an unforeseen error: {row.unforeseen}"
    if row.outcome is sweep.Outcome.REFUSED:
        assert row.why, "a refusal without its reason"
    else:
        assert row.heads + row.channels > 0
    if row.outcome is sweep.Outcome.CHANNELS and row.attention:
        assert row.why, "an attention model whose heads are missing without a reason"


def test_class_whose_input_is_neither_text_nor_images_is_not_built_with_the_reason(sweep):
    row = sweep.sweep_one("WhisperForConditionalGeneration")
    assert row.outcome is sweep.Outcome.NOT_BUILT and "'input_features'" in row.why


def test_the_table_counts_each_outcome_and_a_raw_exception_fails_the_sweep(sweep, tmp_path, monkeypatch, capsys):
    rows = {"BertForMaskedLM": sweep.Row("BertForMaskedLM", sweep.Outcome.HEADS, heads=2, channels=2,
                                         unforeseen="bert.encoder.layer.1: locating its groups failed: IndexError"),
            "GPT2ForSequenceClassification": sweep.Row("GPT2ForSequenceClassification", sweep.Outcome.RAW,
                                                       why="KeyError: 'h'", trace="Traceback ...")}
    monkeypatch.setattr(sweep, "sweep_one", rows.__getitem__)
    out = tmp_path / "sweep.md"
    assert sweep.main(["--classes", *rows, "--out", str(out)]) == 1
    assert sweep.main(["--classes", "BertForMaskedLM", "--out", str(out)]) == 0
    table = out.read_text()
    assert "| BertForMaskedLM | yes | heads found | 2 | 2 |" in table
    assert "hf sweep: 1 classes, 1 built; heads found 1" in table
    assert "failed: IndexError |" in table and "left out by an unforeseen error in 1" in table  # shown, not failing
    assert "KeyError: 'h'" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        sweep.main(["--classes", "NoSuchModelForCausalLM"])


def test_the_summary_gives_the_share_of_attention_models_with_heads_and_those_without_a_reason(sweep):
    rows = [sweep.Row("A", sweep.Outcome.HEADS, heads=2, attention=True),
            sweep.Row("B", sweep.Outcome.CHANNELS, channels=2, why="b.attn: no rule for multiply", attention=True),
            sweep.Row("C", sweep.Outcome.CHANNELS, channels=2, attention=True),
            sweep.Row("D", sweep.Outcome.CHANNELS, channels=4),  # no attention: not counted
            sweep.Row("E", sweep.Outcome.NOT_BUILT, why="too big", attention=True)]
    assert sweep.summary(rows).endswith("with attention 3, heads found in 1 (33.3%), the others without a reason 1")


def test_a_refusal_names_the_part_an_unforeseen_error_left_out(sweep):
    message = ("cannot trace the model (M): ValueError: no; blocks.0: analysing blocks.0 (Block) failed: IndexError: "
               "boom\nTraceback (most recent call last):\n  File ...")
    assert sweep._unforeseen_part(message).startswith("blocks.0: analysing blocks.0 (Block) failed: IndexError: boom")
    assert sweep._unforeseen_part(message.partition("; ")[2]).startswith("blocks.0:")
    assert sweep._unforeseen_part("cannot trace the model (M): ValueError: no") == ""


@pytest.mark.parametrize("name", ["DeepseekV2ForCausalLM", "Mistral4ForSequenceClassification"])
def test_latent_attention_classes_build_consistent_and_have_heads(sweep, name):
    """Their default configs leave the experts per token unset (DeepSeek V2) or size the rotary table from a head
    width that the tiny sizes make unlike the rope part's (Mistral 4): the sweep sets them as released configs do,
    so the class builds, and its latent attention has heads."""
    row = sweep.sweep_one(name)
    assert row.outcome is sweep.Outcome.HEADS and row.heads == 2, f"{row.outcome.value}: {row.why}"


def test_a_refused_class_with_attention_counts_against_the_share(sweep):
    """JetMoE's mixture of attention heads is refused (a router's top-k among heads): its row says it has attention,
    so the share of attention classes with heads counts it (before, a refused row never did)."""
    row = sweep.sweep_one("JetMoeForCausalLM")
    assert row.outcome is sweep.Outcome.REFUSED and row.why and row.attention
