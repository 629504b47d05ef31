"""barter.wrap on a model called with keyword arguments, as a Hugging Face model is: it is analysed on
`example_kwargs`, trains with transfers on non-zero scores, and an averaged copy follows it on the same call."""
import pytest
import torch
from tiny_vit import build_vit, vit_batch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import barter

pytest.importorskip("timm")
T = 30


class KeywordViT(nn.Module):
    """The tiny timm ViT behind a keyword interface: images (and labels) by name, the loss out."""

    def __init__(self) -> None:
        super().__init__()
        self.net = build_vit()

    def forward(self, *, pixel_values: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.net(pixel_values), labels)


class MixedViT(KeywordViT):
    """Images positional, labels by keyword."""

    def forward(self, pixel_values: torch.Tensor, *, labels: torch.Tensor) -> torch.Tensor:
        return super().forward(pixel_values=pixel_values, labels=labels)


def call(step: int) -> dict[str, torch.Tensor]:
    images, labels = vit_batch(step)
    return {"pixel_values": images, "labels": labels}


def scores_are_nonzero(ctl) -> bool:
    """Every layer with units has non-zero running scores D and S: the taps saw the training gradients."""
    return all(float(d.abs().sum()) > 0 and float(s.abs().sum()) > 0
               for kind in ("head", "channel") for d, s in ctl.scores(kind).values() if d.numel())


def train(ctl, opt, *, ema=None, images_positional=False) -> bool:
    """T steps of `model(**call)` (the images first when `images_positional`); whether every executed transfer
    was chosen on non-zero scores."""
    nonzero = True
    for step in range(T):
        opt.zero_grad()
        kwargs = call(step)
        args = (kwargs.pop("pixel_values"),) if images_positional else ()
        ctl.model(*args, **kwargs).backward()
        events, chosen_on = len(ctl.events), scores_are_nonzero(ctl)
        opt.step()
        if any(e["skipped"] is None for e in ctl.events[events:]):
            nonzero &= chosen_on
        if ema is not None:
            ema.update_parameters(ctl.model)
    return nonzero


def test_a_model_called_with_keywords_is_analysed_on_example_kwargs_and_transfers():
    model = KeywordViT()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ctl = barter.wrap(model, opt, total_steps=T, density=0.5, example_kwargs=call(-1))
    assert ctl.surgeon.example_inputs == () and set(ctl.surgeon.example_kwargs) == {"pixel_values", "labels"}
    assert len(ctl.layers["head"]) == len(ctl.layers["channel"]) == 3
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    ctl.track(ema)  # the averaged copy follows the groups found on the keyword call
    assert train(ctl, opt, ema=ema)
    assert any(e["skipped"] is None for e in ctl.events)
    for kind in ("head", "channel"):
        assert sum(g.count for g in ctl.layers[kind]) == sum(ctl.initial[kind])
    assert {n: p.shape for n, p in ema.module.named_parameters()} == {n: p.shape for n, p in model.named_parameters()}


def test_positional_and_keyword_examples_together():
    model = MixedViT()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    images, labels = vit_batch(-1)
    ctl = barter.wrap(model, opt, total_steps=T, density=0.5, example_inputs=(images,),
                      example_kwargs={"labels": labels})
    assert train(ctl, opt, images_positional=True)
    assert any(e["skipped"] is None for e in ctl.events)


def test_the_timm_default_only_without_an_example():
    ctl = barter.wrap(build_vit(), total_steps=T, density=0.5)  # a timm model: its input size
    assert ctl.surgeon.example_inputs[0].shape == (2, 3, 32, 32) and ctl.surgeon.example_kwargs == {}
    with pytest.raises(ValueError, match="example_inputs is required"):
        barter.wrap(KeywordViT(), total_steps=T, density=0.5)


class Attention(nn.Module):
    """Self-attention computed in the model's own forward: the model itself is the host of its heads."""

    def __init__(self, dim: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv, self.proj, self.head = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim), nn.Linear(dim, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, dim = x.shape
        q, k, v = self.qkv(x).reshape(batch, tokens, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        attention = (q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5).softmax(-1)
        mixed = (attention @ v).transpose(1, 2).reshape(batch, tokens, dim)
        return self.head(x + self.proj(mixed)).mean(1)


def tiny_llama() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=2)
    ids = torch.randint(0, 32, (2, 5))
    return transformers.LlamaForCausalLM(config), {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


@pytest.mark.parametrize("build", [lambda: (Attention(), {"x": torch.randn(2, 3, 8)}), tiny_llama],
                         ids=["hosted_by_the_model", "hf_config_read_by_its_layers"])
def test_wrap_analyses_the_model_once(build, monkeypatch):
    """What wrap records on the model (its base, and a transformers config's call record) changes no host the
    analysis checked: the model is analysed once, not again when the analysis installs."""
    from fxsurgery.analysis import value as analysis_value

    torch.manual_seed(0)
    model, kwargs = build()
    real, planned = analysis_value.plan_model, []
    monkeypatch.setattr(analysis_value, "plan_model", lambda *a: planned.append(a) or real(*a))
    ctl = barter.wrap(model, total_steps=T, density=0.5, example_kwargs=kwargs)
    assert len(planned) == 1 and ctl.layers["head"]
