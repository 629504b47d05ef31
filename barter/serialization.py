"""`barter.export` / `barter.load`: a compact model as a directory of safetensors weights and a JSON topology.

`path/model.safetensors` holds the model's state_dict (compact tensors, no zero slots); `path/topology.json` holds
the format version, the base architecture and its constructor arguments (when known: a timm name and arguments, or
"transformers:<class>" and its config), the example call that analysis needs (`inputs`, positional, and
`input_kwargs`, by name: each a tensor's shape and dtype or a plain value), every unit group's description as
analysed (`fxsurgery.GroupDescription.to_dict`, its maximum count among it) with the count it keeps, the parameter
count and the weights' sha256. `path/manifest.json`, written last, records every other file of the directory with
its sha256, and whoever reads a file checks it there first (`barter.files`: the directory is replaced atomically).
`path/model.pt2` holds the compact model in eval mode as a `torch.export` program with a dynamic batch dimension,
which loads without barter installed: `torch.export.load("path/model.pt2").module()(images)`. `load` builds the base
model, checks every key and shape against the recorded counts, resizes it with fxsurgery, and only then loads the
weights.
timm, transformers, the project's models and safetensors are imported when an export or a load first needs them,
so `import barter` stays light.
"""
from __future__ import annotations

import copy
import json
import os
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from fxsurgery import Analysis, AnalysisError, GroupDescription, Surgeon, TraceError, UnitGroup, analyse, solve_counts

from .analysis import ModelBase, default_example_inputs, keep_base, model_base
from .example_call import call_record, recorded_call
from .files import (
    FORMAT,
    MANIFEST,
    TOPOLOGY,
    WEIGHTS,
    ExportError,
    file_sha256,
    read_manifest,
    replace_directory,
    verify_files,
    write_manifest,
)
from .packed_state import pack_state, unpack_state
from .pretrained import is_pretrained_folder, read_pretrained, record_call, with_tied
from .rebuild import RebuildError, check_rebuilds, create_model, timm_arguments, transformers_base

VERSION = 1
PROGRAM = "model.pt2"
RUN_CONFIG = "config.json"  # what a training run directory holds beside its checkpoints (best/, last/)
# the layer below, re-exported where importers found it: atomic directories with manifests, and packed states
__all__ = ["export", "load", "write_export", "read_export", "ExportError", "FORMAT", "VERSION", "WEIGHTS", "TOPOLOGY",
           "PROGRAM", "RUN_CONFIG", "MANIFEST", "replace_directory", "write_manifest", "read_manifest",
           "verify_files", "file_sha256", "pack_state", "unpack_state"]
TOPOLOGY_KEYS = ("architecture", "model_kwargs", "inputs", "input_kwargs", "groups", "parameters", "sha256")


def export(model: nn.Module, path: str | os.PathLike[str], *, example_inputs: tuple | None = None,
           example_kwargs: dict[str, Any] | None = None, architecture: str | None = None,
           model_kwargs: dict[str, Any] | None = None, program: bool = True) -> Path:
    """Write `model`'s weights and topology (and, with `program`, its `torch.export` program) to the directory
    `path` (an earlier export there is replaced atomically) and return `path`.

    The example call is `model(*example_inputs, **example_kwargs)` when either is given, else the one `barter.wrap`
    analysed `model` on or `barter.load` read with it, else a zero batch of a timm model's input size. It is
    recorded as its tensors' shapes and dtypes, with the values of its small integer and boolean tensors (token
    ids, masks, positions): `load` analyses the same call (an all-zero attention mask would mask every token);
    floating tensors come back as zeros. The unit groups come from
    `model.barter_base` when `barter.wrap` or `barter.load` made it (an attribute copies and pickles keep); otherwise
    from analysing the base architecture (`model` itself when none is known: the analysis leaves it untouched) on
    that call, with the kept counts read off `model`'s tensors; a model
    fxsurgery finds no groups in is exported as it is, with a warning. The base architecture is `architecture`
    with `model_kwargs` when given, else a transformers model's class with its config, else timm's
    `pretrained_cfg["architecture"]` with the constructor arguments read back off the model where they differ
    from the registered default (`barter.rebuild`; explicit `model_kwargs` win, over config fields for a
    transformers model). A recorded base that does not rebuild the model's shapes is refused with ExportError,
    saying what to pass.
    """
    path = Path(path)
    replace_directory(path, lambda directory: write_export(
        model, directory, example_inputs=example_inputs, example_kwargs=example_kwargs, architecture=architecture,
        model_kwargs=model_kwargs, program=program))
    return path


def load(path: str | os.PathLike[str], *, model: nn.Module | None = None,
         device: str | torch.device = "cpu") -> nn.Module:
    """Rebuild the compact model exported at `path` (or saved there by a Hugging Face model's `save_pretrained`
    after `wrap`, `barter.pretrained`), load its weights, and return it on `device`.

    `model`, a freshly built base model, is resized in place (needed for architectures outside timm's
    registry and transformers); without it the recorded timm architecture, or transformers class from its
    config, is created (nothing downloaded). Every key and shape is checked before the model is resized, so an
    error leaves `model`'s tensors as they were. The model keeps its base (analysis, architecture, example call)
    as `model.barter_base`, for its next export.
    """
    path = Path(path)
    pretrained = is_pretrained_folder(path)
    topology, weights = read_pretrained(path) if pretrained else read_export(path)
    built = model is None
    if built:
        if topology["architecture"] is None:
            raise ExportError(f"{path} records no base architecture; pass the freshly built model: "
                              "load(path, model=...)")
        model = _build(topology["architecture"], topology["model_kwargs"])
    # a model exported in one float dtype comes back in it, cast before it is analysed again: a graph torch.export
    # captured makes the code's own tensors in the dtypes it was captured with
    dtypes = {t.dtype for t in weights.values() if t.is_floating_point()}
    if len(dtypes) == 1:
        model.to(dtypes.pop())
    analysis = None
    if pretrained:  # the counts each group keeps are read off the weights
        weights = with_tied(model, weights)
        analysis = _analysis(model, recorded_call(model, topology))
        counts = _kept_counts(list(analysis.groups), weights, topology["architecture"])
        topology["groups"] = [{**g.to_dict(), "count": count} for g, count in zip(analysis.groups, counts)]
    surgeon, plan = _resize_plan(model, topology, path, weights=weights, analysis=analysis)
    _check_fits(model, weights, plan, path / WEIGHTS)
    for group, count in plan:
        if count < group.count:
            surgeon.keep(group, range(count))
    model.load_state_dict(weights)
    keep_base(model, ModelBase(None if surgeon is None else surgeon.analysis,
                               architecture=topology["architecture"] if built else None,
                               model_kwargs=topology["model_kwargs"] if built else {},
                               call={"inputs": topology["inputs"], "input_kwargs": topology["input_kwargs"]}))
    record_call(model, {"inputs": topology["inputs"], "input_kwargs": topology["input_kwargs"]})
    return model.to(device)


def write_export(model: nn.Module, directory: Path, *, example_inputs: tuple | None = None,
                 example_kwargs: dict[str, Any] | None = None, architecture: str | None = None,
                 model_kwargs: dict[str, Any] | None = None, program: bool = True) -> None:
    """Write `model.safetensors`, `topology.json` and (with `program`) `model.pt2` into the existing `directory`
    (see `export`)."""
    from safetensors.torch import save_file

    architecture, kwargs = _base_architecture(model, architecture, model_kwargs)
    given = example_inputs is not None or example_kwargs is not None
    groups, call = _groups(model, (example_inputs or (), example_kwargs or {}) if given else None, architecture,
                           kwargs)
    if architecture is not None:
        try:
            check_rebuilds(model, architecture, kwargs, groups)
        except RebuildError as e:
            raise ExportError(str(e)) from e
    weights = {k: v.detach().to("cpu", memory_format=torch.contiguous_format, copy=True)
               for k, v in model.state_dict().items()}
    save_file(weights, directory / WEIGHTS)
    topology = {"format": FORMAT, "version": VERSION, "architecture": architecture, "model_kwargs": kwargs, **call,
                "groups": _group_records(model, groups, architecture),
                "parameters": sum(p.numel() for p in model.parameters()), "sha256": file_sha256(directory / WEIGHTS),
                "program": _write_program(model, directory / PROGRAM, call) if program else None}
    try:
        text = json.dumps(topology, indent=2)
    except TypeError as e:
        raise ExportError(f"model_kwargs must hold JSON values (numbers, strings, lists, dicts): {e}") from e
    (directory / TOPOLOGY).write_text(text + "\n")


def _write_program(model: nn.Module, file: Path, call: dict[str, Any]) -> str | None:
    """Save `model` in eval mode as a `torch.export` program of the recorded call with a dynamic batch dimension
    (loads with plain torch: `torch.export.load(file).module()(*args, **kwargs)`); return its file name, or None
    with a warning when torch.export cannot capture the model (the weights and topology are exported all the
    same)."""
    copied = copy.deepcopy(model).eval()  # a wrapped model copies itself without its score taps
    args, kwargs = recorded_call(copied, call)
    dynamic = torch.export.ShapesCollection()
    for value in (*args, *kwargs.values()):
        if torch.is_tensor(value):
            dynamic[value] = {0: torch.export.Dim.AUTO}
    try:
        with torch.random.fork_rng(devices=[]):
            exported = torch.export.export(copied, args, kwargs, dynamic_shapes=dynamic)
        torch.export.save(exported, file)
    except Exception as e:  # torch.export raises many types for code it cannot capture
        warnings.warn(f"{type(model).__name__} is exported without {file.name} (torch.export: {type(e).__name__}: "
                      f"{str(e).splitlines()[0] if str(e) else ''})", stacklevel=3)
        file.unlink(missing_ok=True)
        return None
    return file.name


def read_export(path: Path) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """The topology and the weights (on the CPU) exported at `path`, after checking the format and checksum."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    topology_file, weights_file = path / TOPOLOGY, path / WEIGHTS
    if (path / RUN_CONFIG).is_file():
        raise ExportError(f"{path} is a training run, not an export: load its checkpoint, "
                          f"barter.load('{path / 'best'}') (or '{path / 'last'}'), or write a standalone export "
                          f"with `barter export {path} OUT`")
    if not topology_file.is_file():
        raise ExportError(f"no barter export at {path} (no {TOPOLOGY})")
    verify_files(path, [TOPOLOGY, WEIGHTS])
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
    digest = file_sha256(weights_file)
    if digest != topology["sha256"]:
        raise ExportError(f"{weights_file}: checksum mismatch (sha256 {digest}, recorded {topology['sha256']}); "
                          "the file is corrupt or was changed after export")
    try:
        return topology, load_file(weights_file)
    except SafetensorError as e:
        raise ExportError(f"cannot read {weights_file} ({e})") from e


def _base_architecture(model: nn.Module, architecture: str | None, model_kwargs: dict[str, Any] | None
                       ) -> tuple[str | None, dict[str, Any]]:
    """The architecture and constructor arguments that rebuild `model`'s base: the explicit ones, else those
    `load` built it with, else a transformers model's class and config, else what timm's config and the model
    tell (`barter.rebuild`)."""
    if architecture is not None:
        return architecture, dict(model_kwargs or {})
    base = model_base(model)
    if base is not None and base.architecture is not None:
        return base.architecture, {**base.model_kwargs, **(model_kwargs or {})}
    hugging_face = transformers_base(model)
    if hugging_face is not None:
        architecture, config = hugging_face
        return architecture, {**config, **(model_kwargs or {})}
    architecture = (getattr(model, "pretrained_cfg", None) or {}).get("architecture")
    groups = None if base is None or base.analysis is None else list(base.analysis.groups)
    read = {} if architecture is None else timm_arguments(model, architecture, groups)
    return architecture, {**read, **(model_kwargs or {})}


def _groups(model: nn.Module, example: tuple[tuple, dict[str, Any]] | None, architecture: str | None,
            kwargs: dict[str, Any]) -> tuple[list[GroupDescription], dict[str, Any]]:
    """The unit groups of the model as built (its `barter_base`), else of its base, and the record of the example
    call (see `export`)."""
    base = model_base(model)
    analysis = None if base is None else base.analysis
    if analysis is not None:
        return list(analysis.groups), call_record(*(example or (analysis.example_inputs, analysis.example_kwargs)))
    if example is not None:
        call = call_record(*example)
    elif base is not None and base.call is not None:
        call = base.call
    else:
        try:
            call = call_record(default_example_inputs(model), {})
        except ValueError as e:
            raise ExportError(f"{e}; pass example_inputs= and/or example_kwargs=") from e
    with torch.random.fork_rng(devices=[]):  # building and analysing the base leaves the caller's RNG alone
        built = model if architecture is None else _build(architecture, kwargs)
        try:
            return list(analyse(built, *recorded_call(built, call)).groups), call
        except (TraceError, AnalysisError) as e:
            warnings.warn(f"{type(model).__name__} is exported without unit groups (loading takes it as "
                          f"built): {e}", stacklevel=1)
            return [], call


def _group_records(model: nn.Module, groups: list[GroupDescription], architecture: str | None
                   ) -> list[dict[str, Any]]:
    """Every unit group's description (`GroupDescription.to_dict`) with its kept `count`, read off `model`'s tensors
    (whichever analysis resized them since)."""
    tensors = {**dict(model.named_parameters(remove_duplicate=False)),
               **dict(model.named_buffers(remove_duplicate=False))}
    return [{**g.to_dict(), "count": count} for g, count in zip(groups, _kept_counts(groups, tensors, architecture))]


def _kept_counts(groups: list[GroupDescription], tensors: dict[str, Tensor], architecture: str | None) -> list[int]:
    """The units of each group (found in the base) that the compact model's tensors hold (groups in segments of one
    fused projection's dim are told apart together)."""
    missing = next((sl.name for g in groups for sl in g.slices if sl.name not in tensors), None)
    if missing is not None:
        raise ExportError(f"the model has no tensor {missing}, which {architecture} has; "
                          "pass the model's own architecture= and model_kwargs=")
    counts = solve_counts([g.slices for g in groups], lambda name, dim: tensors[name].shape[dim])
    if counts is None:
        names = sorted({sl.name for g in groups for sl in g.slices})
        raise ExportError(f"the model's tensors {names[:5]}{' ...' if len(names) > 5 else ''} do not hold a whole "
                          "number of its groups' units; pass the model's own architecture= and model_kwargs=")
    return counts


def _build(architecture: str, kwargs: dict[str, Any]) -> nn.Module:
    """The base model `architecture` built with `kwargs` (`barter.rebuild.create_model`)."""
    with torch.random.fork_rng(devices=[]):
        try:
            return create_model(architecture, kwargs)
        except RebuildError as e:
            raise ExportError(str(e)) from e
        except (RuntimeError, TypeError, ValueError) as e:
            raise ExportError(f"cannot build {architecture} with {kwargs}: {e}") from e


def _resize_plan(model: nn.Module, topology: dict[str, Any], path: Path, *, weights: dict[str, Tensor],
                 analysis: Analysis | None = None) -> tuple[Surgeon | None, list[tuple[UnitGroup, int]]]:
    """`model`'s unit groups with their recorded counts (found by `analysis`, else by analysing `model` on the
    recorded call); none when every group keeps all its units and the weights hold nothing that installing the
    groups adds (the index buffers of heads that read their slopes through a gather: a clone at the full count
    changes them)."""
    recorded = topology["groups"]
    if all(g["count"] == g["max_count"] for g in recorded) and weights.keys() <= model.state_dict().keys():
        return None, []
    surgeon = Surgeon(model, analysis or _analysis(model, recorded_call(model, topology)))
    plan = []
    for record in recorded:
        exported, count = GroupDescription.from_dict(record), record["count"]
        try:
            group = surgeon.group(exported.name)
        except KeyError as e:
            raise ExportError(f"{path / TOPOLOGY}: {type(model).__name__} has no unit group {exported.name!r} "
                              f"(its groups: {[x.name for x in surgeon.groups]})") from e
        if group.max_count != exported.max_count:  # a constructor argument the export could not tell (same shapes)
            raise ExportError(f"{path / TOPOLOGY}: {exported.name} has {exported.max_count} units at most in the "
                              f"export, {group.max_count} in the {type(model).__name__} rebuilt; pass the model built "
                              "with its own arguments: load(path, model=...)")
        if not group.min_count <= count <= group.count:
            raise ExportError(f"{path / TOPOLOGY}: {exported.name} keeps {count} units; {type(model).__name__} has "
                              f"{group.count} (at least {group.min_count} must stay)")
        plan.append((group, count))
    return surgeon, plan


def _analysis(model: nn.Module, call: tuple[tuple, dict[str, Any]]) -> Analysis:
    """`model`'s analysis on the recorded `call`, or ExportError saying why there is none."""
    try:
        return analyse(model, *call)
    except (TraceError, AnalysisError) as e:
        raise ExportError(f"cannot find the unit groups of {type(model).__name__} to resize it: {e}") from e


def _check_fits(model: nn.Module, weights: dict[str, Tensor], plan: list[tuple[UnitGroup, int]],
                weights_file: Path) -> None:
    """Raise ExportError unless `weights` has exactly the keys and shapes of `model` resized by `plan`."""
    shapes = {k: list(v.shape) for k, v in model.state_dict().items()}
    for group, count in plan:  # a dim may hold several groups' segments: each changes it by its own units
        for sl in group.slices:
            if sl.name in shapes:
                shapes[sl.name][sl.dim] -= sl.outer * (group.count - count) * sl.inner
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
