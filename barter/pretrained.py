"""A Hugging Face model folder of a compact model (`save_pretrained`, `Trainer.save_model`, the Trainer's
checkpoints, a Hub download): its config carries the call barter analysed the model on (`CONFIG_KEY`), so that
`barter.load` rebuilds the model from the folder alone, finding the groups the first analysis found. (transformers'
`from_pretrained` refuses the folder: the compact tensors do not have the sizes its config gives.)"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from .example_call import call_record
from .files import TOPOLOGY, WEIGHTS, ExportError
from .rebuild import TRANSFORMERS

CONFIG_KEY = "barter_call"
CONFIG = "config.json"
SHARD_INDEX = "model.safetensors.index.json"
SAMPLES = 2  # batch samples of the call kept in the config (torch.export specialises a batch of one)


def sampled_call(inputs: tuple, input_kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """The record of the call `model(*inputs, **input_kwargs)` with its first SAMPLES samples where its tensors share
    a batch dim, or None for values that no file records."""
    batch = {t.shape[0] for t in (*inputs, *input_kwargs.values()) if torch.is_tensor(t) and t.dim()}
    few = (lambda t: t[:SAMPLES] if torch.is_tensor(t) and t.dim() else t) if len(batch) == 1 else (lambda t: t)
    try:
        return call_record(tuple(few(t) for t in inputs), {name: few(t) for name, t in input_kwargs.items()})
    except ExportError:
        return None


def record_call(model: nn.Module, call: dict[str, Any] | None) -> None:
    """Write `call` (a call record) into a transformers model's config, which `save_pretrained` saves; no record
    leaves the config as it was (`barter.load` then says the folder lacks the call)."""
    transformers = sys.modules.get("transformers")
    config = getattr(model, "config", None)
    if call is not None and transformers is not None and isinstance(config, transformers.PretrainedConfig):
        setattr(config, CONFIG_KEY, call)


def recorded_call(model: nn.Module) -> dict[str, Any] | None:
    """The call record `record_call` wrote into `model`'s config, if any."""
    return getattr(getattr(model, "config", None), CONFIG_KEY, None)


def is_pretrained_folder(path: Path) -> bool:
    """A folder transformers wrote (a config and safetensors weights), not a barter export."""
    weights = (path / WEIGHTS).is_file() or (path / SHARD_INDEX).is_file()
    return (path / CONFIG).is_file() and weights and not (path / TOPOLOGY).is_file()


def read_pretrained(path: Path) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """The architecture, config and recorded call of the compact model saved at `path` (a topology without groups:
    their counts are read off the weights once the model is built), and its weights."""
    try:
        config = json.loads((path / CONFIG).read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ExportError(f"{path / CONFIG} is not valid JSON ({e})") from e
    call = config.pop(CONFIG_KEY, None) if isinstance(config, dict) else None
    if call is None:
        raise ExportError(f"{path} is a Hugging Face model folder whose {CONFIG} has no {CONFIG_KEY}: it was not saved "
                          "from a model barter wrapped (or its call held values no file records); write an export "
                          "with barter.export(model, path)")
    architectures = config.get("architectures") or []
    if len(architectures) != 1:
        raise ExportError(f"{path / CONFIG} names {len(architectures)} model classes (architectures); "
                          "one rebuilds the model")
    return {"architecture": TRANSFORMERS + architectures[0], "model_kwargs": config, **call}, _weights(path)


def _weights(path: Path) -> dict[str, Tensor]:
    """The tensors of the folder's safetensors file, or of every shard its index names."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    files = [path / WEIGHTS]
    if not files[0].is_file():
        index = json.loads((path / SHARD_INDEX).read_text())
        files = [path / name for name in sorted(set(index["weight_map"].values()))]
    weights: dict[str, Tensor] = {}
    for file in files:
        try:
            weights.update(load_file(file))
        except (SafetensorError, FileNotFoundError) as e:
            raise ExportError(f"cannot read {file} ({e})") from e
    return weights


def with_tied(model: nn.Module, weights: dict[str, Tensor]) -> dict[str, Tensor]:
    """`weights` with the entries transformers leaves out of the file for a tensor the model ties to another
    (an output embedding that is the input one): each takes the saved entry of its tensor."""
    names: dict[int, list[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        names.setdefault(id(tensor), []).append(name)
    out = dict(weights)
    for tied in names.values():
        saved = next((name for name in tied if name in weights), None)
        for name in tied if saved is not None else ():
            out.setdefault(name, weights[saved])
    return out
