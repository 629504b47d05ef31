"""`fxsurgery.analyse` on transformers' own zoo: every `*ForCausalLM`, `*ForSequenceClassification`,
`*ForImageClassification`, `*ForMaskedLM` and `*ForConditionalGeneration` class of the installed transformers,
built offline at a tiny size from its config's defaults, analysed on a call made the way the Trainer makes it
(keyword arguments: input_ids / attention_mask / labels for text, pixel_values / labels for images; an
encoder-decoder gets its decoder inputs from the labels).

Each row says whether the class was built (or why not: a config that cannot be made tiny, a main input that is
neither text nor images, a Trainer call the model itself does not serve) and the analysis' outcome: heads found,
channels only, refused (an `AnalysisError` / `TraceError`, or no group with the reasons left out) with the reason's
first words, or a raw exception (anything else), which fails the sweep. A part of the model that an unforeseen
exception inside the analysis left out (a refusal that names the error and its traceback: a bug of the analysis,
not a limit of it) is shown in a column of its own, whatever the outcome. Ends with `hf sweep: <counts>`.

    python benchmarks/hf_sweep.py --timeout-per-model 120 --out runs/hf_sweep.md   (in `make soak`)
"""
from __future__ import annotations

import argparse
import enum
import multiprocessing
import re
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

HEADS = ("ForCausalLM", "ForSequenceClassification", "ForImageClassification", "ForMaskedLM",
         "ForConditionalGeneration")
HIDDEN, LAYERS, ATTENTION_HEADS, KEY_VALUE_HEADS, FFN, VOCAB, POSITIONS, IMAGE, PATCH = 32, 2, 4, 2, 64, 128, 64, 32, 8
MAX_PARAMETERS = 20_000_000  # a config that stays bigger than this was not made tiny
BATCH, LENGTH = 2, 8
SIZES = {  # config attribute -> tiny value, by the names transformers' configs use
    **dict.fromkeys(("hidden_size", "d_model", "n_embd", "embed_dim", "dim", "word_embed_proj_dim",
                     "pooler_hidden_size"), HIDDEN),
    **dict.fromkeys(("num_hidden_layers", "n_layer", "n_layers", "num_layers", "encoder_layers", "decoder_layers",
                     "num_decoder_layers", "num_encoder_layers"), LAYERS),
    **dict.fromkeys(("num_attention_heads", "n_head", "n_heads", "num_heads", "encoder_attention_heads",
                     "decoder_attention_heads"), ATTENTION_HEADS),
    **dict.fromkeys(("num_key_value_heads", "n_head_kv", "num_kv_heads", "multi_query_group_num"), KEY_VALUE_HEADS),
    **dict.fromkeys(("intermediate_size", "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim", "n_inner", "d_ff",
                     "ffn_hidden_size", "moe_intermediate_size", "shared_expert_intermediate_size",
                     "dense_intermediate_size"), FFN),
    **dict.fromkeys(("head_dim", "d_kv", "kv_channels", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"),
                    HIDDEN // ATTENTION_HEADS),
    "qk_head_dim": 2 * HIDDEN // ATTENTION_HEADS,  # multi-head latent attention: nope + rope
    "rotary_dim": HIDDEN // ATTENTION_HEADS,  # the rotated dims of a head (GPT-J, CodeGen): at most its head dim
    **dict.fromkeys(("kv_lora_rank", "q_lora_rank"), HIDDEN // 2),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts"), 4),
    **dict.fromkeys(("num_experts_per_tok", "top_k", "moe_topk"), 2),
    "vocab_size": VOCAB,
    **dict.fromkeys(("max_position_embeddings", "n_positions", "max_seq_len", "max_sequence_length"), POSITIONS),
    **dict.fromkeys(("n_group", "topk_group"), 1),  # expert groups of the router
    "image_size": IMAGE, "patch_size": PATCH, "window_size": 4,
}
TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id",
             "cls_token_id", "mask_token_id", "unk_token_id")


class Outcome(enum.Enum):
    HEADS = "heads found"
    CHANNELS = "channels only"
    REFUSED = "refused"
    RAW = "raw exception"
    SILENT = "no group, no reason"
    NOT_BUILT = "not built"
    TIMED_OUT = "timed out"


FAILURES = (Outcome.RAW, Outcome.SILENT)  # what fails the sweep: neither groups nor a reason
UNFORESEEN = "Traceback (most recent call last)"  # ends the reason of a part an unforeseen exception left out


@dataclass
class Row:
    """One class of the sweep: its outcome, the groups found, why (a refusal's or a failure's first words) and
    the seconds spent building and analysing it."""

    name: str
    outcome: Outcome
    heads: int = 0
    channels: int = 0
    why: str = ""
    seconds: float = 0.0
    trace: str = ""  # a raw exception's traceback head
    unforeseen: str = ""  # the first part left out by an unforeseen exception (a bug of the analysis): its reason
    attention: bool = False  # the model has an attention module (the measure counts these)

    @property
    def built(self) -> bool:
        return self.outcome not in (Outcome.NOT_BUILT, Outcome.TIMED_OUT)


class NotBuilt(Exception):
    """The class cannot be built tiny offline or called as the Trainer calls it; the message says why."""


def classes() -> list[str]:
    """The sweep's class names in the installed transformers, sorted."""
    import transformers
    return sorted(name for name in dir(transformers)
                  if name.endswith(HEADS) and not name.startswith(("Auto", "TF", "Flax")))


def first_words(text: str, words: int = 20) -> str:
    return " ".join(str(text).split()[:words])


def shrink(config: Any, seen: set[int] | None = None) -> None:
    """Set the size attributes of ``config`` and of its nested configs to the tiny values of SIZES, per-stage lists
    (hierarchical models) to tiny stages, and token ids outside the tiny vocabulary into it."""
    from transformers import PretrainedConfig
    seen = set() if seen is None else seen
    if id(config) in seen:
        return
    seen.add(id(config))
    attributes = config.to_dict() if hasattr(config, "to_dict") else {}
    staged = _int_list(getattr(config, "depths", None))  # a hierarchical model: its width and stage count derive
    for name, value in list(vars(config).items()) + [(n, getattr(config, n, None)) for n in attributes]:
        if staged and name in ("hidden_size", "num_layers", "num_hidden_layers"):
            continue
        if isinstance(value, PretrainedConfig):
            shrink(value, seen)
        elif name in SIZES and isinstance(value, int) and not isinstance(value, bool):
            setattr(config, name, min(value, SIZES[name]))
        elif name in ("hidden_sizes", "embed_dims", "embedding_sizes") and _int_list(value):
            setattr(config, name, [min(v, 16 * 2 ** i) for i, v in enumerate(value)])
        elif name == "depths" and _int_list(value):
            setattr(config, name, [1] * len(value))
        elif name in ("num_heads", "num_attention_heads") and _int_list(value):
            setattr(config, name, [min(v, 2) for v in value])
    if getattr(config, "num_key_value_heads", None) and getattr(config, "num_attention_heads", None):
        if isinstance(config.num_attention_heads, int):
            config.num_key_value_heads = min(config.num_key_value_heads, config.num_attention_heads)
            if getattr(config, "kv_lora_rank", None):  # latent attention: a key/value head per query head
                config.num_key_value_heads = config.num_attention_heads
    partial = (getattr(config, "rope_parameters", None) or {}).get("partial_rotary_factor")
    if getattr(config, "qk_rope_head_dim", None) and getattr(config, "head_dim", None) and partial:
        config.head_dim = int(config.qk_rope_head_dim / partial)  # the rotary table's width is the rope part's
    if getattr(config, "n_routed_experts", None) and getattr(config, "num_experts_per_tok", "absent") is None:
        config.num_experts_per_tok = SIZES["num_experts_per_tok"]  # as released checkpoints set it
    layers = getattr(config, "num_hidden_layers", None)
    for name in ("layer_types", "block_types", "attention_layers"):
        if isinstance(getattr(config, name, None), list) and isinstance(layers, int):
            setattr(config, name, getattr(config, name)[:layers])
    vocab = getattr(config, "vocab_size", None)
    if isinstance(vocab, int):
        for name in TOKEN_IDS:
            token = getattr(config, name, None)
            if isinstance(token, int) and token >= vocab:
                setattr(config, name, TOKEN_IDS.index(name) + 1)
        if getattr(config, "pad_token_id", "absent") is None:
            config.pad_token_id = 0
    if getattr(config, "is_encoder_decoder", False) and getattr(config, "decoder_start_token_id", None) is None:
        config.decoder_start_token_id = getattr(config, "pad_token_id", None) or 0  # as released checkpoints set it


def _int_list(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and bool(value) and all(isinstance(v, int) for v in value)


def build(name: str) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """The class ``name`` at a tiny size from its config's defaults, in train mode, and the keyword call the Trainer
    makes of it; NotBuilt saying why when either cannot be had offline."""
    import transformers
    cls = getattr(transformers, name)
    config_class = getattr(cls, "config_class", None)
    if config_class is None:
        raise NotBuilt("no config class")
    try:
        config = config_class()
        shrink(config)
        with torch.device("meta"):  # sized before any memory is filled
            size = sum(p.numel() for p in cls(config).parameters())
        if size > MAX_PARAMETERS:
            raise NotBuilt(f"config cannot be made tiny: {size:,} parameters")
        torch.manual_seed(0)
        model = cls(config)
    except NotBuilt:
        raise
    except Exception as err:  # noqa: BLE001 - any failure of the model's own code: the class is not built
        raise NotBuilt(f"config cannot be made tiny: {type(err).__name__}: {err}") from err
    call = trainer_call(name, model)
    try:
        with torch.no_grad():
            model.eval()(**call)
            model.train()(**call)  # as the Trainer calls it (a model may ask more of a training call)
    except Exception as err:  # noqa: BLE001
        raise NotBuilt(f"the Trainer's call fails on the model itself: {type(err).__name__}: {err}") from err
    return model.train(), call


def trainer_call(name: str, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The keyword arguments a Trainer batch gives ``model``: labels as the head reads them."""
    config = model.config
    generator = torch.Generator().manual_seed(0)
    classify = name.endswith(("ForSequenceClassification", "ForImageClassification"))
    classes_labels = torch.arange(BATCH) % max(getattr(config, "num_labels", 2), 1)
    main = getattr(model, "main_input_name", "input_ids")
    if main == "pixel_values":
        size = _nested(config, "image_size") or IMAGE
        size = size if isinstance(size, int) else size[0]
        channels = _nested(config, "num_channels") or 3
        pixels = torch.randn(BATCH, channels, size, size, generator=generator)
        return {"pixel_values": pixels, "labels": classes_labels}
    if main != "input_ids":
        raise NotBuilt(f"main input {main!r} is neither text nor images")
    vocab = _nested(config, "vocab_size") or VOCAB
    ids = torch.randint(3, max(4, min(vocab, VOCAB)), (BATCH, LENGTH), generator=generator)
    eos = _nested(config, "eos_token_id")
    if isinstance(eos, int) and eos < vocab:
        ids[:, -1] = eos  # each sequence ends as a tokenizer ends it (a classifier may read the end token)
    labels = classes_labels if classify else ids.clone()
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def _nested(config: Any, name: str) -> Any:
    """``config.name``, or that of its first nested config that has it (a vision or text sub-config)."""
    if getattr(config, name, None) is not None:
        return getattr(config, name)
    for sub in ("text_config", "vision_config", "encoder", "decoder"):
        value = getattr(getattr(config, sub, None), name, None)
        if value is not None:
            return value
    return None


def sweep_one(name: str) -> Row:
    """Build ``name`` tiny and analyse it on the Trainer's call; the row records the outcome."""
    from fxsurgery import AnalysisError, TraceError, analyse
    start = time.perf_counter()
    try:
        model, call = build(name)
    except NotBuilt as err:
        return Row(name, Outcome.NOT_BUILT, why=first_words(err), seconds=time.perf_counter() - start)
    try:
        analysis = analyse(model, (), call)
    except (AnalysisError, TraceError) as err:  # a refused model with attention counts against the share too
        return Row(name, Outcome.REFUSED, why=first_words(f"{type(err).__name__}: {err}"),
                   seconds=time.perf_counter() - start, unforeseen=_unforeseen_part(str(err)),
                   attention=bool(attention_modules(model)))
    except Exception as err:  # noqa: BLE001 - what the sweep exists to find
        head = "".join(traceback.format_exception(err)[-6:])
        return Row(name, Outcome.RAW, why=first_words(f"{type(err).__name__}: {err}"),
                   seconds=time.perf_counter() - start, trace=head, attention=bool(attention_modules(model)))
    heads = sum(g.kind == "head" for g in analysis.groups)
    channels = len(analysis.groups) - heads
    seconds = time.perf_counter() - start
    left = [(lo.module or "(model)", reason) for lo in analysis.left_out for reason in lo.reasons]
    unforeseen = next((first_words(f"{module}: {reason}") for module, reason in left if UNFORESEEN in reason), "")
    attention = bool(attention_modules(model))
    if not analysis.groups:
        why = first_words(left[0][1]) if left else ""
        return Row(name, Outcome.REFUSED if why else Outcome.SILENT, why=why, seconds=seconds, unforeseen=unforeseen,
                   attention=attention)
    why = "" if heads else first_words(_why_no_heads(model, left))
    return Row(name, Outcome.HEADS if heads else Outcome.CHANNELS, heads, channels, why=why, seconds=seconds,
               unforeseen=unforeseen, attention=attention)


def attention_modules(model: torch.nn.Module) -> list[str]:
    """The names of ``model``'s attention modules, by transformers' class names (the sweep's own notion: the
    analysis reads graphs, not names)."""
    return [name for name, module in model.named_modules() if "Attention" in type(module).__name__]


def _why_no_heads(model: torch.nn.Module, left: list[tuple[str, str]]) -> str:
    """Why a model with channel groups has no head group: the first reason given for a part within an attention
    module or that speaks of heads, else "" (the heads are missing without a reason)."""
    attention = attention_modules(model)
    return next((f"{module}: {reason}" for module, reason in left
                 if re.search(r"\bheads?\b", reason) or any(module.startswith(a) for a in attention)), "")


def _unforeseen_part(message: str) -> str:
    """The first words of the part of a refusal's ``message`` (parts joined by "; ") that an unforeseen error left
    out, or "" where there is none."""
    at = message.find(UNFORESEEN)
    if at < 0:
        return ""
    start = message.rfind("; ", 0, at)
    return first_words(message[start + 2 if start >= 0 else 0:])


def _serve(connection: Any) -> None:
    """A worker process: says it is ready once its imports are done, then sweeps the names it is sent, one row
    back for each."""
    import transformers  # noqa: F401

    import fxsurgery  # noqa: F401 - imported before the first class's clock starts
    torch.set_num_threads(1)
    connection.send("ready")
    while (name := connection.recv()) is not None:
        connection.send(sweep_one(name))


class Worker:
    """A spawned process that sweeps one class at a time, so that a class that hangs can be skipped: past the
    timeout its process is killed and the next class gets a fresh one."""

    def __init__(self) -> None:
        self.process = None

    def sweep(self, name: str, timeout: float) -> Row:
        if self.process is None:
            context = multiprocessing.get_context("spawn")
            self.connection, child = context.Pipe()
            self.process = context.Process(target=_serve, args=(child,), daemon=True)
            self.process.start()
            self.connection.recv()  # its imports take no class's time
        start = time.perf_counter()
        self.connection.send(name)
        if self.connection.poll(timeout):
            try:
                return self.connection.recv()
            except EOFError:
                self.close()
                return Row(name, Outcome.RAW, why="the worker process died", seconds=time.perf_counter() - start)
        self.close()
        return Row(name, Outcome.TIMED_OUT, why=f"past {timeout:g} s", seconds=time.perf_counter() - start)

    def close(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.join()
            self.process = None


def table(rows: list[Row]) -> str:
    """The rows as a markdown table, then the summary line."""
    lines = ["| class | built | outcome | heads | channels | why | seconds | left out by an unforeseen error |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        why, unforeseen = (text.replace("|", "/") for text in (r.why, r.unforeseen))
        lines.append(f"| {r.name} | {'yes' if r.built else 'no'} | {r.outcome.value} | {r.heads} | {r.channels} "
                     f"| {why} | {r.seconds:.1f} | {unforeseen} |")
    return "\n".join([*lines, "", summary(rows)])


def summary(rows: list[Row]) -> str:
    """The counts of each outcome, then the measure: of the classes built with attention, the share with heads
    found, and how many of the others give no reason."""
    counts = {outcome: sum(r.outcome is outcome for r in rows) for outcome in Outcome}
    built = sum(r.built for r in rows)
    unforeseen = sum(bool(r.unforeseen) for r in rows)
    attending = [r for r in rows if r.built and r.attention]
    with_heads = sum(r.outcome is Outcome.HEADS for r in attending)
    silent = sum(r.outcome is not Outcome.HEADS and not r.why for r in attending)
    share = f"{100 * with_heads / len(attending):.1f}%" if attending else "n/a"
    return (f"hf sweep: {len(rows)} classes, {built} built; " +
            ", ".join(f"{outcome.value} {count}" for outcome, count in counts.items()) +
            f"; a part left out by an unforeseen error in {unforeseen}; with attention {len(attending)}, heads found "
            f"in {with_heads} ({share}), the others without a reason {silent}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--classes", nargs="+", help="only these classes")
    p.add_argument("--limit", type=int, help="only the first N classes")
    p.add_argument("--timeout-per-model", type=float,
                   help="seconds after which a class is skipped and reported timed out (each class then runs in a "
                        "worker process)")
    p.add_argument("--out", type=Path, help="also write the table to this markdown file")
    args = p.parse_args(argv)
    names = args.classes or classes()
    unknown = sorted(set(names) - set(classes()))
    if unknown:
        p.error(f"not a swept class of the installed transformers: {', '.join(unknown)}")
    names = names[:args.limit] if args.limit is not None else names
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
    worker = Worker() if args.timeout_per_model else None
    rows = []
    try:
        for name in names:
            row = worker.sweep(name, args.timeout_per_model) if worker else sweep_one(name)
            rows.append(row)
            if args.out:  # kept current, so that an interrupted sweep leaves its rows
                args.out.write_text(table(rows) + "\n")
            print(f"{row.name:<48} {'yes' if row.built else 'no':>3} {row.outcome.value:<14} {row.heads:>3} "
                  f"{row.channels:>3} {row.seconds:6.1f}s  {row.why}", flush=True)
            if row.unforeseen:
                print(f"    left out by an unforeseen error: {row.unforeseen}", flush=True)
            if row.trace:
                print(re.sub("^", "    ", row.trace, flags=re.M), flush=True)
    finally:
        if worker:
            worker.close()
    print(summary(rows))
    return 1 if any(r.outcome in FAILURES for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
