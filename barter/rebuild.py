"""What rebuilds a model's base: timm constructor arguments read back off the model (or a transformers model's
class and config), and the check that the recorded architecture and arguments give a model with the dense shapes
of the one exported.

timm keeps the registered `pretrained_cfg` when a model is built with overrides, so the overrides are read off the
model's modules (`READERS`: one small function per constructor argument), compared with the registered default
built on the meta device (no memory, no initialisation cost) with the arguments read so far, and recorded where
they differ and the model's class takes them. `check_rebuilds` builds the recorded base on the meta device and
compares every tensor's dense shape: an export that `barter.load` could not rebuild is refused while the model is
still there to ask about.

A transformers model is recorded as "transformers:<class>" with its full config as the arguments: fxsurgery resizes
tensors, not the config, so the config describes the dense base. transformers is imported only to build one.
"""
from __future__ import annotations

import inspect
import json
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fxsurgery import GroupDescription

from .analysis import default_example_inputs

TRANSFORMERS = "transformers:"  # the architecture of a transformers model: "transformers:<class name>"


class RebuildError(ValueError):
    """The recorded architecture and arguments do not rebuild the model; the message says what to pass."""


def timm_arguments(model: nn.Module, architecture: str, groups: list[GroupDescription] | None) -> dict[str, Any]:
    """The constructor arguments of a timm `model` that differ from `architecture`'s registered default.

    `groups`, the model's unit groups as built (with their maximum counts), when known: a compact model's widths
    are read from them rather than from its resized tensors (each reader takes None for "unknown, perhaps
    compact" and [] for a dense model).
    """
    timm = timm_with_models()
    registered = timm.models.get_pretrained_cfg(architecture)
    if registered is None:
        return {}
    conv = dict(model.named_modules()).get(model.pretrained_cfg.get("first_conv"))
    current = {"num_classes": getattr(model, "num_classes", None), "in_chans": getattr(conv, "in_channels", None),
               "img_size": _image_size(*default_example_inputs(model)[0].shape[2:])}
    default = {"num_classes": registered.num_classes, "in_chans": registered.input_size[0],
               "img_size": _image_size(*registered.input_size[1:])}
    kwargs = {k: v for k, v in current.items() if v is not None and v != default[k]}
    accepted = inspect.signature(type(model).__init__).parameters
    try:
        base = build_on_meta(architecture, kwargs)
    except RebuildError:
        return kwargs  # `check_rebuilds` says what is wrong
    for name, reader in READERS.items():  # in order: a width is compared with a base of the same depth and dim
        value = reader(model, groups) if name in accepted else None
        if value is not None and value != reader(base, []):
            kwargs[name] = value
            try:
                base = build_on_meta(architecture, kwargs)
            except RebuildError:
                pass  # a width the default heads do not divide: the arguments read next make it buildable
    return kwargs


def check_rebuilds(model: nn.Module, architecture: str, kwargs: dict[str, Any], groups: list[GroupDescription]) -> None:
    """Raise RebuildError unless `architecture` built with `kwargs` has `model`'s keys and, every unit group at
    its maximum, its shapes. A group's tensor the base lacks is state installing the groups adds (which of a
    module input's entries a layer's units read), made again when `load` installs them."""
    base = build_on_meta(architecture, kwargs)
    expected = {k: list(v.shape) for k, v in base.state_dict().items()}
    actual = dense_shapes(model, groups)
    installed = {sl.name for group in groups for sl in group.slices}
    missing = [k for k in expected if k not in actual]
    unexpected = [k for k in actual if k not in expected and k not in installed]
    wrong = [f"{k} is {actual[k]} in the model, {shape} in the rebuilt one" for k, shape in expected.items()
             if k in actual and actual[k] != shape]
    problems = [f"{label}: {items[:3]}{' ...' if len(items) > 3 else ''}"
                for label, items in (("keys it lacks", missing), ("keys only the model has", unexpected),
                                     ("shapes", wrong)) if items]
    if problems:
        raise RebuildError(
            f"{architecture} built with {kwargs} does not rebuild this model (" + "; ".join(problems) + "); pass "
            "the constructor arguments it was built with that differ from the registered default: "
            "barter.export(model, path, model_kwargs={...})")


def dense_shapes(model: nn.Module, groups: list[GroupDescription]) -> dict[str, list[int]]:
    """`model`'s state_dict shapes with every unit group at its maximum count."""
    shapes = {k: list(v.shape) for k, v in model.state_dict().items()}
    # the groups' segments tile each dim they slice, but for the elements no group holds (``fixed``)
    dense: dict[tuple[str, int], int] = {}
    for group in groups:
        for sl in group.slices:
            if sl.name in shapes:
                key = (sl.name, sl.dim)
                dense[key] = dense.get(key, sl.fixed) + sl.outer * group.max_count * sl.inner
    for (name, dim), size in dense.items():
        shapes[name][dim] = size
    return shapes


def build_on_meta(architecture: str, kwargs: dict[str, Any]) -> nn.Module:
    """`create_model(architecture, kwargs)` for its shapes: on the meta device (nothing allocated), or on the CPU
    for a model whose construction reads tensor values."""
    errors = (RuntimeError, TypeError, ValueError, AssertionError, NotImplementedError)
    with torch.random.fork_rng(devices=[]):
        try:
            with torch.device("meta"):
                return create_model(architecture, kwargs)
        except errors:
            pass
        try:
            return create_model(architecture, kwargs)
        except errors as e:
            raise RebuildError(f"cannot build {architecture} with {kwargs}: {e}") from e


def create_model(architecture: str, kwargs: dict[str, Any]) -> nn.Module:
    """The base model `architecture` with random weights, nothing downloaded: a "transformers:<class>" built from
    its config `kwargs`, else `timm.create_model(architecture, **kwargs)` (the project's models included)."""
    if not architecture.startswith(TRANSFORMERS):
        return timm_with_models().create_model(architecture, **kwargs)
    try:
        import transformers
    except ImportError as e:
        raise RebuildError(f"{architecture} needs transformers, which is not installed") from e
    name = architecture.removeprefix(TRANSFORMERS)
    model_class = getattr(transformers, name, None)
    if not (isinstance(model_class, type) and issubclass(model_class, transformers.PreTrainedModel)):
        raise RebuildError(f"transformers {transformers.__version__} has no model class {name!r} (architecture "
                           f"{architecture!r})")
    return model_class(model_class.config_class.from_dict(kwargs))


def transformers_base(model: nn.Module) -> tuple[str, dict[str, Any]] | None:
    """"transformers:<class>" and the config (JSON values, the attention implementation included) of a model of a
    class transformers exports, else None. A model of its classes means transformers is imported already."""
    transformers = sys.modules.get("transformers")
    if transformers is None or not isinstance(model, transformers.PreTrainedModel):
        return None
    name = type(model).__name__
    if getattr(transformers, name, None) is not type(model):
        return None  # a subclass of the user's own: load(path, model=...) builds it
    config = json.loads(model.config.to_json_string(use_diff=False))
    attention = getattr(model.config, "_attn_implementation", None)
    if isinstance(attention, str):
        config["attn_implementation"] = attention
    return TRANSFORMERS + name, config


def timm_with_models():
    """timm with the project's models (`barter.models`) registered: the one place that registers them, on first
    use, so that `import barter` stays light."""
    import timm

    from . import models  # noqa: F401  (registers the project's models with timm)

    return timm


def _image_size(height: int, width: int) -> int | list[int]:
    return height if height == width else [height, width]


def _first_block(model: nn.Module) -> nn.Module | None:
    blocks = getattr(model, "blocks", None)
    return blocks[0] if isinstance(blocks, (nn.ModuleList, nn.Sequential)) and len(blocks) else None


def _patch_size(model: nn.Module, groups: list[GroupDescription] | None) -> int | list[int] | None:
    size = getattr(getattr(model, "patch_embed", None), "patch_size", None)
    if isinstance(size, int):
        return size
    return _image_size(*size) if isinstance(size, tuple) and len(size) == 2 else None


def _depth(model: nn.Module, groups: list[GroupDescription] | None) -> int | None:
    blocks = getattr(model, "blocks", None)
    return len(blocks) if isinstance(blocks, (nn.ModuleList, nn.Sequential)) else None


def _stages(model: nn.Module) -> list[nn.Module] | None:
    """The stages of a hierarchical model (in `layers` or `stages`, each with its `blocks`), else None."""
    stages = getattr(model, "layers", None) or getattr(model, "stages", None)
    if not isinstance(stages, (nn.ModuleList, nn.Sequential)) or not all(_depth(s, None) for s in stages):
        return None
    return list(stages)


def _depths(model: nn.Module, groups: list[GroupDescription] | None) -> list[int] | None:
    stages = _stages(model)
    return None if stages is None else [_depth(stage, None) for stage in stages]


def _embed_dim(model: nn.Module, groups: list[GroupDescription] | None) -> int | None:
    dim = getattr(model, "embed_dim", None)
    return dim if isinstance(dim, int) else None


def _num_heads(model: nn.Module, groups: list[GroupDescription] | None) -> int | list[int] | None:
    """The heads of the first block's attention (of the block itself where it has no attention module: a parallel
    block), or of each stage's first block in a hierarchical model (fxsurgery keeps the module attribute as
    built)."""
    stages = _stages(model)
    firsts = [_first_block(model)] if stages is None else [_first_block(stage) for stage in stages]
    heads = [getattr(getattr(block, "attn", block), "num_heads", None) for block in firsts]
    if not all(isinstance(h, int) for h in heads):
        return None
    return heads[0] if stages is None else heads


def _mlp_ratio(model: nn.Module, groups: list[GroupDescription] | None) -> float | None:
    """The first block's dense MLP width over the embedding width; unknown (None) without the groups, as a
    copy of a compact model holds resized tensors."""
    fc1 = getattr(getattr(_first_block(model), "mlp", None), "fc1", None)
    dim = _embed_dim(model, groups)
    if groups is None or not isinstance(fc1, nn.Linear) or dim is None:
        return None
    name = next(n for n, m in model.named_modules() if m is fc1) + ".weight"
    return dense_shapes(model, groups)[name][0] / dim


def _class_token(model: nn.Module, groups: list[GroupDescription] | None) -> bool | None:
    return model.cls_token is not None if hasattr(model, "cls_token") else None


def _global_pool(model: nn.Module, groups: list[GroupDescription] | None) -> str | None:
    pool = getattr(model, "global_pool", None)
    return pool if isinstance(pool, str) else None


def _reg_tokens(model: nn.Module, groups: list[GroupDescription] | None) -> int | None:
    tokens = getattr(model, "num_reg_tokens", None)
    return tokens if isinstance(tokens, int) else None


def _qkv_bias(model: nn.Module, groups: list[GroupDescription] | None) -> bool | None:
    qkv = getattr(getattr(_first_block(model), "attn", None), "qkv", None)
    return qkv.bias is not None if isinstance(qkv, nn.Linear) else None


def _no_embed_class(model: nn.Module, groups: list[GroupDescription] | None) -> bool | None:
    value = getattr(model, "no_embed_class", None)
    return value if isinstance(value, bool) else None


# timm constructor argument -> its value read off a model (None: not readable there)
READERS: dict[str, Callable[[nn.Module, list[GroupDescription] | None], Any]] = {
    "patch_size": _patch_size, "depth": _depth, "depths": _depths, "embed_dim": _embed_dim, "num_heads": _num_heads,
    "mlp_ratio": _mlp_ratio, "class_token": _class_token, "global_pool": _global_pool, "reg_tokens": _reg_tokens,
    "qkv_bias": _qkv_bias, "no_embed_class": _no_embed_class,
}
