"""The models of the combination matrix, each tiny (a few thousand parameters, 2 layers of 2 heads and 4 FFN
channels): a timm ViT, a captured Hugging Face encoder (BERT, called with keywords), captured Hugging Face decoders
called with their key/value cache (GPT-2; Phi-3, grouped-query attention in one fused q/k/v projection, 2 key/value
heads of 2 query heads each; Falcon multi-query, 4 query heads beside one key/value head in a fused projection;
Llama 4, rotary in complex form and chunked attention over grouped queries), a hand-written model whose heads are
mixed by heads x heads maps, and a convolutional transformer whose FFN is convolutional.
Each case names, in the model's own layout, the weights through which a unit writes (``writes``): the reference
of a removal zeroes them on a copy, without reading fxsurgery's slices.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from projections import Projection
from torch import nn

CLASSES = 3
VOCAB = 30
TOKENS = 6
BATCH = 2

Batch = tuple[tuple, dict[str, Any], torch.Tensor]  # positional inputs, keyword inputs, target


@dataclass(frozen=True)
class Case:
    """A model of the matrix: how to build it, its batches, its loss, and where its units write."""

    name: str
    build: Callable[[], nn.Module]
    batch: Callable[[int], Batch]  # the batch of a training step: the same at every call
    logits: Callable[[Any], torch.Tensor]  # the logits in the model's output
    writes: Callable[[str, str], list[Projection]]  # (group module, kind) -> the weights its units write through
    rebuilt_by_load: bool  # barter.load builds it from the export alone (timm, transformers)

    probe: Callable[[nn.Module, Batch], list[torch.Tensor]] | None = None  # what the checks compare: the logits

    def outputs(self, model: nn.Module, batch: Batch) -> list[torch.Tensor]:
        """What the checks compare of `model` on `batch`: its logits, or what `probe` says."""
        if self.probe is not None:
            return self.probe(model, batch)
        args, kwargs, _ = batch
        return [self.logits(model(*args, **kwargs))]

    def loss(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        logits = self.logits(output)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1))


def _generator(step: int) -> torch.Generator:
    return torch.Generator().manual_seed(1000 + step)


def _images(channels_size: tuple[int, int]) -> Callable[[int], Batch]:
    channels, size = channels_size

    def batch(step: int) -> Batch:
        g = _generator(step)
        return (torch.randn(BATCH, channels, size, size, generator=g),), {}, torch.randint(0, CLASSES, (BATCH,),
                                                                                             generator=g)
    return batch


def _tokens(step: int) -> Batch:
    g = _generator(step)
    return (torch.randn(BATCH, TOKENS, 5, generator=g),), {}, torch.randint(0, CLASSES, (BATCH,), generator=g)


def _sentences(step: int) -> Batch:
    """Token ids with padding at the end of the second sentence."""
    g = _generator(step)
    mask = torch.ones(BATCH, TOKENS, dtype=torch.long)
    mask[1, TOKENS - 2:] = 0
    kwargs = {"input_ids": torch.randint(0, VOCAB, (BATCH, TOKENS), generator=g), "attention_mask": mask}
    return (), kwargs, torch.randint(0, CLASSES, (BATCH,), generator=g)


def _decoder_tokens(step: int) -> Batch:
    """Token ids called with the cache on (`use_cache=True`: the call returns each layer's keys and values), the
    next tokens as targets."""
    ids = torch.randint(0, VOCAB, (BATCH, TOKENS + 1), generator=_generator(step))
    return (), {"input_ids": ids[:, :-1], "use_cache": True}, ids[:, 1:]


def _decoder_probe(model: nn.Module, batch: Batch) -> list[torch.Tensor]:
    """The logits, and the logits of the next token decoded from the returned cache (whose head dim follows each
    layer's heads)."""
    _, kwargs, target = batch
    output = model(**kwargs)
    following = model(input_ids=target[:, -1:], past_key_values=output.past_key_values, use_cache=True)
    return [output.logits, following.logits]


def vit() -> nn.Module:
    import timm

    return timm.create_model("vit_tiny_patch16_224", num_classes=CLASSES, img_size=16, patch_size=8, depth=2,
                             embed_dim=16, num_heads=2, mlp_ratio=0.25)


def bert() -> nn.Module:
    import transformers

    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=4, max_position_embeddings=16, num_labels=CLASSES,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return transformers.BertForSequenceClassification(config)


def gpt2() -> nn.Module:
    import transformers

    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=2, n_head=2, n_inner=4,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def phi3() -> nn.Module:
    """Grouped-query attention in one fused q/k/v projection: 4 query heads over 2 key/value heads."""
    import transformers

    config = transformers.Phi3Config(vocab_size=VOCAB, hidden_size=16, intermediate_size=4, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                                     pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return transformers.Phi3ForCausalLM(config)


def falcon_multi_query() -> nn.Module:
    """Multi-query attention with parallel attention and MLP: 4 query heads beside one key/value head, fused."""
    import transformers

    config = transformers.FalconConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
                                       multi_query=True, new_decoder_architecture=False, parallel_attn=True,
                                       ffn_hidden_size=4, hidden_dropout=0.0, attention_dropout=0.0, bos_token_id=0,
                                       eos_token_id=0)
    return transformers.FalconForCausalLM(config)


def llama4() -> nn.Module:
    """Rotary in complex form (``view_as_complex``), chunked attention, 4 query heads over 2 key/value heads; dense
    MLPs (a router's data-made top-k choice would be no unit)."""
    import transformers

    config = transformers.Llama4TextConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=4,
                                           intermediate_size_mlp=4, num_hidden_layers=2, num_attention_heads=4,
                                           num_key_value_heads=2, head_dim=4, max_position_embeddings=16,
                                           moe_layers=[], attention_chunk_size=4, attention_dropout=0.0,
                                           pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return transformers.Llama4ForCausalLM(config)


def mpt() -> nn.Module:
    """ALiBi: slopes the model computes once at its head count, read per head through an index buffer; the whole
    model captured by torch.export, its cache among the outputs."""
    import transformers

    config = transformers.MptConfig(vocab_size=VOCAB, d_model=16, n_heads=4, n_layers=2, expansion_ratio=1,
                                    max_seq_len=16, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return transformers.MptForCausalLM(config)


def deepseek_v3() -> nn.Module:
    """Multi-head latent attention: keys assembled in place from per-head parts and one rotary part every head
    shares; the whole model captured by torch.export, its cache (of the latents) among the outputs."""
    import transformers

    config = transformers.DeepseekV3Config(vocab_size=VOCAB, hidden_size=16, intermediate_size=16, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=4, q_lora_rank=8,
                                           kv_lora_rank=8, qk_rope_head_dim=2, qk_nope_head_dim=2, v_head_dim=4,
                                           first_k_dense_replace=2, max_position_embeddings=16, pad_token_id=0,
                                           bos_token_id=1, eos_token_id=2)
    return transformers.DeepseekV3ForCausalLM(config)


def head_mixing() -> nn.Module:
    from zoo_mixed import MixedStyle, MixedTransformer

    return MixedTransformer(MixedStyle(heads=2, head_dim=4, mlp_hidden=4, mixing="pre_post"), classes=CLASSES)


def conv_ffn() -> nn.Module:
    from zoo import ConvTransformer

    return ConvTransformer(heads=2, head_dim=4, hidden=4, classes=CLASSES)


def _joined(module: str, suffix: str) -> str:
    return f"{module}.{suffix}" if module else suffix


def _writes(heads: list[tuple[str, int, int]], channels: list[tuple[str, int, int]],
            root_channels: list[tuple[str, int, int]] = ()) -> Callable[[str, str], list[Projection]]:
    """(suffix under the group's module, dim, a unit's width) of each kind's output weights; ``root_channels``
    for a channel group whose module is the whole model."""
    def writes(module: str, kind: str) -> list[Projection]:
        table = heads if kind == "head" else channels if module else root_channels
        return [Projection(_joined(module, suffix), dim, width) for suffix, dim, width in table]
    return writes


CASES = {case.name: case for case in (
    Case("timm_vit", vit, _images((3, 16)), lambda out: out,
         _writes([("proj.weight", 1, 8)], [("fc2.weight", 1, 1)]), rebuilt_by_load=True),
    Case("hf_encoder", bert, _sentences, lambda out: out.logits,
         _writes([("output.dense.weight", 1, 8)], [("output.dense.weight", 1, 1)], [("classifier.weight", 1, 1)]),
         rebuilt_by_load=True),
    Case("hf_decoder_cache", gpt2, _decoder_tokens, lambda out: out.logits,
         _writes([("c_proj.weight", 0, 8)], [("c_proj.weight", 0, 1)]), rebuilt_by_load=True, probe=_decoder_probe),
    Case("hf_fused_gqa_cache", phi3, _decoder_tokens, lambda out: out.logits,
         _writes([("o_proj.weight", 1, 8)], [("down_proj.weight", 1, 1)]), rebuilt_by_load=True,
         probe=_decoder_probe),  # a unit: a key/value head with its 2 query heads
    Case("hf_multi_query_cache", falcon_multi_query, _decoder_tokens, lambda out: out.logits,
         _writes([("dense.weight", 1, 4)], [("dense_4h_to_h.weight", 1, 1)]), rebuilt_by_load=True,
         probe=_decoder_probe),  # a unit: a query head; the one key/value head stays
    Case("hf_complex_rotary_cache", llama4, _decoder_tokens, lambda out: out.logits,
         _writes([("o_proj.weight", 1, 8)], [("down_proj.weight", 1, 1)]), rebuilt_by_load=True,
         probe=_decoder_probe),  # a unit: a key/value head with its 2 query heads
    Case("hf_alibi_cache", mpt, _decoder_tokens, lambda out: out.logits,
         _writes([("out_proj.weight", 1, 4)], [("down_proj.weight", 1, 1)]), rebuilt_by_load=True,
         probe=_decoder_probe),
    Case("hf_latent_cache", deepseek_v3, _decoder_tokens, lambda out: out.logits,
         _writes([("o_proj.weight", 1, 4)], [("down_proj.weight", 1, 1)]), rebuilt_by_load=True,
         probe=_decoder_probe),  # the latents' channel groups are not exact: barter keeps them dense
    Case("head_mixing", head_mixing, _tokens, lambda out: out,
         _writes([("proj.weight", 1, 4), ("pre", 0, 1), ("post", 0, 1)], [("fc2.weight", 1, 1)]),
         rebuilt_by_load=False),
    Case("conv_ffn", conv_ffn, _images((3, 8)), lambda out: out,
         _writes([("proj.weight", 1, 4)], [("fc2.weight", 1, 1)]), rebuilt_by_load=False),
)}
