"""`barter.export` / `barter.load`: a compact model as a directory of safetensors weights and a JSON topology.

`path/model.safetensors` holds the model's state_dict (compact tensors, no zero slots); `path/topology.json`
holds the format version, the base architecture and its constructor arguments (when known), the example input
shapes that analysis needs, every unit group's kept and maximum count, the parameter count and the weights'
sha256. `load` builds the base model, checks every key and shape against the recorded counts, resizes it with
fxsurgery, and only then loads the weights. timm, the project's models and safetensors are imported when an
export or a load first needs them, so `import barter` stays light.
"""
from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from fxsurgery import AnalysisError, Surgeon, TraceError, UnitGroup

from .analysis import default_example_inputs, record_analysis, recorded_analysis

FORMAT = "barter-export"
VERSION = 1
WEIGHTS = "model.safetensors"
TOPOLOGY = "topology.json"
TOPOLOGY_KEYS = ("architecture", "model_kwargs", "inputs", "groups", "parameters", "sha256")

# models that `load` built from a recorded architecture -> (architecture, model_kwargs), for their next export
_BUILT_AS: weakref.WeakKeyDictionary[nn.Module, tuple[str, dict[str, Any]]] = weakref.WeakKeyDictionary()


class ExportError(ValueError):
    """An export that cannot be written, read, or fitted to its model; the message names the file, key or shape."""


def export(model: nn.Module, path: str | os.PathLike[str], *, example_inputs: tuple[Tensor, ...] | None = None,
           architecture: str | None = None, model_kwargs: dict[str, Any] | None = None) -> Path:
    """Write `model`'s weights and topology to the directory `path` (an earlier export there is replaced
    atomically) and return `path`.

    The unit groups come from `barter.wrap` or `barter.load` when one resized `model`; otherwise from analysing
    the base architecture (a copy of `model` when none is known) on `example_inputs` (default: a timm model's
    input size), with the kept counts read off `model`'s tensors; a model fxsurgery finds no groups in is
    exported as it is, with a warning. The base architecture is `architecture` with `model_kwargs` when given,
    else timm's `pretrained_cfg["architecture"]` with the class count, input channels and image size where
    they differ from the registered default (explicit `model_kwargs` win).
    """
    path = Path(path)
    replace_directory(path, lambda directory: write_export(model, directory, example_inputs=example_inputs,
                                                           architecture=architecture, model_kwargs=model_kwargs))
    return path


def load(path: str | os.PathLike[str], *, model: nn.Module | None = None,
         device: str | torch.device = "cpu") -> nn.Module:
    """Rebuild the compact model exported at `path`, load its weights, and return it on `device`.

    `model`, a freshly built base model, is resized in place (needed for architectures outside timm's
    registry); without it the recorded timm architecture is created. Every key and shape is checked before the
    model is resized, so an error leaves `model`'s tensors as they were.
    """
    path = Path(path)
    topology, weights = read_export(path)
    if model is None:
        if topology["architecture"] is None:
            raise ExportError(f"{path} records no base architecture; pass the freshly built model: "
                              "load(path, model=...)")
        model = _build(topology["architecture"], topology["model_kwargs"])
        _BUILT_AS[model] = (topology["architecture"], topology["model_kwargs"])
    surgeon, plan = _resize_plan(model, topology, path)
    _check_fits(model, weights, plan, path / WEIGHTS)
    for group, count in plan:
        if count < group.count:
            surgeon.keep(group, range(count))
    dtypes = {t.dtype for t in weights.values() if t.is_floating_point()}
    if len(dtypes) == 1:  # a model exported in half precision comes back in it
        model.to(dtypes.pop())
    model.load_state_dict(weights)
    if surgeon is not None:
        record_analysis(surgeon)
    return model.to(device)


def write_export(model: nn.Module, directory: Path, *, example_inputs: tuple[Tensor, ...] | None = None,
                 architecture: str | None = None, model_kwargs: dict[str, Any] | None = None) -> None:
    """Write `model.safetensors` and `topology.json` into the existing `directory` (see `export`)."""
    from safetensors.torch import save_file

    architecture, kwargs = _base_architecture(model, architecture, model_kwargs)
    groups, inputs = _groups(model, example_inputs, architecture, kwargs)
    weights = {k: v.detach().to("cpu", memory_format=torch.contiguous_format, copy=True)
               for k, v in model.state_dict().items()}
    save_file(weights, directory / WEIGHTS)
    topology = {"format": FORMAT, "version": VERSION, "architecture": architecture, "model_kwargs": kwargs,
                "inputs": inputs, "groups": groups, "parameters": sum(p.numel() for p in model.parameters()),
                "sha256": _sha256(directory / WEIGHTS)}
    try:
        text = json.dumps(topology, indent=2)
    except TypeError as e:
        raise ExportError(f"model_kwargs must hold JSON values (numbers, strings, lists, dicts): {e}") from e
    (directory / TOPOLOGY).write_text(text + "\n")


def read_export(path: Path) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """The topology and the weights (on the CPU) exported at `path`, after checking the format and checksum."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    topology_file, weights_file = path / TOPOLOGY, path / WEIGHTS
    if not topology_file.is_file():
        raise ExportError(f"no barter export at {path} (no {TOPOLOGY})")
    try:
        topology = json.loads(topology_file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ExportError(f"{topology_file} is not valid JSON ({e})") from e
    if not isinstance(topology, dict) or topology.get("format") != FORMAT:
        raise ExportError(f"{topology_file} is not a barter export topology")
    if topology.get("version") != VERSION:
        raise ExportError(f"{topology_file} has format version {topology.get('version')}; this barter reads {VERSION}")
    missing = [k for k in TOPOLOGY_KEYS if k not in topology]
    if missing:
        raise ExportError(f"{topology_file} lacks {', '.join(missing)}")
    if not weights_file.is_file():
        raise ExportError(f"{weights_file} is missing")
    digest = _sha256(weights_file)
    if digest != topology["sha256"]:
        raise ExportError(f"{weights_file}: checksum mismatch (sha256 {digest}, recorded {topology['sha256']}); "
                          "the file is corrupt or was changed after export")
    try:
        return topology, load_file(weights_file)
    except SafetensorError as e:
        raise ExportError(f"cannot read {weights_file} ({e})") from e


def replace_directory(path: Path, fill: Callable[[Path], None]) -> None:
    """Fill a fresh directory beside `path`, then swap it in: `path` never holds a half-written export.

    Only an earlier export (a directory with topology.json) or an empty directory is replaced.
    """
    if path.exists() and not ((path / TOPOLOGY).is_file() or (path.is_dir() and not any(path.iterdir()))):
        raise ExportError(f"{path} exists and is not a barter export; refusing to replace it")
    staging, retired = path.with_name(path.name + ".tmp"), path.with_name(path.name + ".old")
    for leftover in (staging, retired):
        shutil.rmtree(leftover, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        fill(staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if path.exists():
        os.replace(path, retired)
    os.replace(staging, path)
    shutil.rmtree(retired, ignore_errors=True)


def _base_architecture(model: nn.Module, architecture: str | None, model_kwargs: dict[str, Any] | None
                       ) -> tuple[str | None, dict[str, Any]]:
    """The timm name and constructor arguments that rebuild `model`'s base: the explicit ones, else those `load`
    built it with, else what timm's config and the model tell."""
    if architecture is not None:
        return architecture, dict(model_kwargs or {})
    if model in _BUILT_AS:
        architecture, built_kwargs = _BUILT_AS[model]
        return architecture, {**built_kwargs, **(model_kwargs or {})}
    architecture = (getattr(model, "pretrained_cfg", None) or {}).get("architecture")
    read = {} if architecture is None else _timm_arguments(model, architecture)
    return architecture, {**read, **(model_kwargs or {})}


def _timm_arguments(model: nn.Module, architecture: str) -> dict[str, Any]:
    """num_classes, in_chans and img_size of a timm model, where they differ from the registered default."""
    default = _timm().models.get_pretrained_cfg(architecture)
    if default is None:
        return {}
    conv = dict(model.named_modules()).get(model.pretrained_cfg.get("first_conv"))
    current = {"num_classes": getattr(model, "num_classes", None), "in_chans": getattr(conv, "in_channels", None),
               "img_size": _image_size(*default_example_inputs(model)[0].shape[2:])}
    registered = {"num_classes": default.num_classes, "in_chans": default.input_size[0],
                  "img_size": _image_size(*default.input_size[1:])}
    return {k: v for k, v in current.items() if v is not None and v != registered[k]}


def _image_size(height: int, width: int) -> int | list[int]:
    return height if height == width else [height, width]


def _groups(model: nn.Module, example_inputs: tuple[Tensor, ...] | None, architecture: str | None,
            kwargs: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every unit group's record ({name, kind, module, count, max_count}) and the example inputs' shapes.

    The groups are those of the model as built (see `record_analysis`), else of its base; the kept counts are
    read off the model's tensors, whichever analysis resized them since.
    """
    analysis = recorded_analysis(model)
    if analysis is not None:
        groups = analysis.groups
        inputs = _input_specs(example_inputs if example_inputs is not None else analysis.example_inputs)
    else:
        try:
            inputs = _input_specs(example_inputs if example_inputs is not None else default_example_inputs(model))
        except ValueError as e:
            raise ExportError(str(e)) from e
        with torch.random.fork_rng(devices=[]):  # building and analysing the base leaves the caller's RNG alone
            base = copy.deepcopy(model) if architecture is None else _build(architecture, kwargs)
            try:
                groups = Surgeon(base, _zero_inputs(base, inputs)).groups
            except (TraceError, AnalysisError) as e:
                warnings.warn(f"{type(model).__name__} is exported without unit groups (loading takes it as "
                              f"built): {e}", stacklevel=1)
                groups = []
    tensors = {**dict(model.named_parameters(remove_duplicate=False)),
               **dict(model.named_buffers(remove_duplicate=False))}
    return [{"name": g.name, "kind": g.kind, "module": g.module, "count": _kept_count(g, tensors, architecture),
             "max_count": g.max_count} for g in groups], inputs


def _kept_count(group: UnitGroup, tensors: dict[str, Tensor], architecture: str | None) -> int:
    """The units of `group` (found in the base) that the compact model's tensors hold."""
    counts = set()
    for sl in group.slices:
        if sl.name not in tensors:
            raise ExportError(f"the model has no tensor {sl.name}, which {architecture} has; "
                              "pass the model's own architecture= and model_kwargs=")
        size, per_unit = tensors[sl.name].shape[sl.dim], sl.outer * sl.inner
        counts.add(size // per_unit if size % per_unit == 0 else -1)
    if len(counts) != 1 or -1 in counts:
        raise ExportError(f"{group.name}: the model's tensors {[sl.name for sl in group.slices]} do not hold a "
                          f"whole number of its units; pass the model's own architecture= and model_kwargs=")
    return counts.pop()


def _input_specs(inputs: tuple) -> list[dict[str, Any]]:
    if not all(torch.is_tensor(t) for t in inputs):
        raise ExportError("example_inputs must be a tuple of tensors to be recorded")
    return [{"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")} for t in inputs]


def _zero_inputs(model: nn.Module, inputs: list[dict[str, Any]]) -> tuple[Tensor, ...]:
    """Zero tensors shaped like the recorded inputs, on `model`'s device; floating ones in `model`'s dtype (a
    half-precision export's base is built in single precision)."""
    p = next(model.parameters())
    dtypes = [getattr(torch, s["dtype"]) for s in inputs]
    return tuple(torch.zeros(s["shape"], dtype=p.dtype if dtype.is_floating_point else dtype, device=p.device)
                 for s, dtype in zip(inputs, dtypes))


def _build(architecture: str, kwargs: dict[str, Any]) -> nn.Module:
    """The base model `timm.create_model(architecture, **kwargs)` (the project's models included)."""
    with torch.random.fork_rng(devices=[]):
        try:
            return _timm().create_model(architecture, **kwargs)
        except (RuntimeError, TypeError) as e:
            raise ExportError(f"cannot build {architecture} with {kwargs}: {e}") from e


def _timm():
    """timm with the project's models registered (imported on first use)."""
    import timm

    import models  # noqa: F401  (registers the project's models with timm)

    return timm


def _resize_plan(model: nn.Module, topology: dict[str, Any], path: Path
                 ) -> tuple[Surgeon | None, list[tuple[UnitGroup, int]]]:
    """`model`'s unit groups with their recorded counts; no analysis when every group keeps all its units."""
    recorded = topology["groups"]
    if all(g["count"] == g["max_count"] for g in recorded):
        return None, []
    try:
        surgeon = Surgeon(model, _zero_inputs(model, topology["inputs"]))
    except (TraceError, AnalysisError) as e:
        raise ExportError(f"cannot find the unit groups of {type(model).__name__} to resize it: {e}") from e
    plan = []
    for g in recorded:
        try:
            group = surgeon.group(g["name"])
        except KeyError as e:
            raise ExportError(f"{path / TOPOLOGY}: {type(model).__name__} has no unit group {g['name']!r} "
                              f"(its groups: {[x.name for x in surgeon.groups]})") from e
        if not group.min_count <= g["count"] <= group.count:
            raise ExportError(f"{path / TOPOLOGY}: {g['name']} keeps {g['count']} units; {type(model).__name__} has "
                              f"{group.count} (at least {group.min_count} must stay)")
        plan.append((group, g["count"]))
    return surgeon, plan


def _check_fits(model: nn.Module, weights: dict[str, Tensor], plan: list[tuple[UnitGroup, int]],
                weights_file: Path) -> None:
    """Raise ExportError unless `weights` has exactly the keys and shapes of `model` resized by `plan`."""
    shapes = {k: list(v.shape) for k, v in model.state_dict().items()}
    for group, count in plan:
        for sl in group.slices:
            if sl.name in shapes:
                shapes[sl.name][sl.dim] = sl.outer * count * sl.inner
    missing = [k for k in shapes if k not in weights]
    unexpected = [k for k in weights if k not in shapes]
    wrong = [f"{k} is {list(weights[k].shape)} in the file, {shape} in the model" for k, shape in shapes.items()
             if k in weights and list(weights[k].shape) != shape]
    problems = [f"{label}: {items[:5]}{' ...' if len(items) > 5 else ''}"
                for label, items in (("missing keys", missing), ("unexpected keys", unexpected), ("shapes", wrong))
                if items]
    if problems:
        raise ExportError(f"{weights_file} does not fit {type(model).__name__} resized to its topology ("
                          + "; ".join(problems) + ")")


def _sha256(file: Path) -> str:
    digest = hashlib.sha256()
    with file.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
