"""What a run starts from: the model with the weights `init_from` names (a dense run, one of its checkpoints, or a
timm weights file), and the training batches that compact initialisation by score (`init="score"`) measures on.

The classifier is new only when the class count differs from the source's; every other tensor must fit. A timm
weights file is loaded by timm itself (`pretrained_cfg_overlay=dict(file=...)`), which also adapts the positional
embedding of a ViT to another image size and the first convolution to other input channels.
"""
from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import Dataset

from ..options import Options
from ..rebuild import timm_with_models
from .batches import epoch_batches
from .config import WRAP_METHODS, ConfigError, TrainConfig
from .loading import batches_of
from .processes import is_main
from .runlog import CheckpointError, find_checkpoint, load_checkpoint

WEIGHT_FILES = (".safetensors", ".pth", ".pt", ".bin")  # what timm's load_state_dict reads
TRAINED_START_OPTIONS = MappingProxyType({"min_heads": 1})  # a trained start's transfer options unless set
TRAINED_START_EVIDENCE = (
    "`benchmarks/compress.py --methods static --variants paper fade carry count0.5` and `--variants keephead` (a "
    "trained ViT on MNIST-5k compressed to density 0.3, 5 epochs of fine-tuning, seeds 0-5; README, 'From a "
    "trained model') gave BARTER - Static -5.07 points [-7.02, -3.11] with the paper's policy (min_heads 0), -5.88 "
    "with fade, -6.30 with carry and -5.23 with count0.5, each below Static on 6 of 6 seeds: its one head transfer "
    "takes the only head of a block. With min_heads 1 (keephead) it gave -0.08 [-0.29, +0.12], level with Static."
)


class TrainedStartWarning(UserWarning):
    """A run moves units of a trained model (`init_from`) under a policy that lets a transfer take a layer's last
    head, measured to cost accuracy there (`TRAINED_START_EVIDENCE`); silence it with
    `warnings.filterwarnings("ignore", category=TrainedStartWarning)`."""


def wrap_options(config: TrainConfig) -> dict[str, Any]:
    """The run's `barter.wrap` options: `barter_options`, with `TRAINED_START_OPTIONS` added where BARTER starts from
    a trained model (`init_from`) and the options neither set them nor name a transfer policy (then all its parts
    are that policy's: `transfer_policy="paper"` is the paper's, min_heads 0)."""
    options = dict(config.barter_options)
    if config.method in WRAP_METHODS and config.init_from is not None and "transfer_policy" not in options:
        options = {**TRAINED_START_OPTIONS, **options}
    return options


def warn_of_transfers_from_trained(config: TrainConfig) -> None:
    """Warn once per run (its main process) when BARTER starts from a trained model with transfers that may take a
    layer's last head: the evidence and the choice that measured best. A matched-compute continuation makes no
    transfer: no warning."""
    if config.method == "barter" and config.init_from is not None and config.continue_from is None and is_main() \
            and Options.from_kwargs(**wrap_options(config)).policy.min_heads == 0:
        warnings.warn(f"init_from {config.init_from} with method barter and min_heads 0: {TRAINED_START_EVIDENCE} "
                      "Leave min_heads and transfer_policy unset (min_heads 1), or use method static.",
                      TrainedStartWarning, stacklevel=2)


def build_model(architecture: str, kwargs: dict[str, Any], init_from: str | None) -> nn.Module:
    """`timm.create_model(architecture, **kwargs)` (the project's models registered), with the weights of
    `init_from` when given: a timm weights file, else a dense run directory or checkpoint (its best one)."""
    if init_from is not None and Path(init_from).suffix in WEIGHT_FILES:
        return _create_from_file(architecture, kwargs, Path(init_from))
    model = timm_with_models().create_model(architecture, **kwargs)
    if init_from is not None:
        load_pretrained(model, init_from)
    return model


def reloads_on_resume(config: TrainConfig) -> bool:
    """Whether a resumed run loads `init_from` again before the wrap: the initial widths of a global allocation, and
    the units init "score" keeps, are chosen on those weights, and the wrap of the resumed run must choose the same
    (the checkpoint's weights replace them afterwards)."""
    options = config.barter_options
    return config.method in WRAP_METHODS and (options.get("init") == "score" or options.get("allocation") == "global")


def load_pretrained(model: nn.Module, source: str) -> None:
    """Load a dense run's weights (its best checkpoint, or a checkpoint directory); the classifier stays freshly
    initialised where its shape differs (another class count). Sparse methods then keep a subset of these weights."""
    path = find_checkpoint(source, "best")
    state = load_checkpoint(path)
    if state.get("controller") is not None or state.get("sparse") is not None:
        raise CheckpointError(f"{path}: init_from needs a dense run's checkpoint (this one is compact or sparse)")
    head = _classifier(model.pretrained_cfg) + "."
    own = model.state_dict()
    weights = state["model"]
    if any(k.startswith(head) and (k not in own or own[k].shape != v.shape) for k, v in weights.items()):
        weights = {k: v for k, v in weights.items() if not k.startswith(head)}
    try:
        missing, unexpected = model.load_state_dict(weights, strict=False)
    except RuntimeError as e:
        raise CheckpointError(f"{path}: weights do not fit {type(model).__name__}: {e}") from e
    wrong = unexpected + [k for k in missing if not k.startswith(head)]
    if wrong:
        raise CheckpointError(f"{path}: weights do not fit the model (mismatched keys: {wrong[:5]})")


def calibration_batches(config: TrainConfig, train_set: Dataset, device: torch.device
                        ) -> Iterator[tuple[Tensor, Tensor]] | None:
    """The first `config.calibration` batches of a shuffle of the training set seeded by the run's seed (the
    training augmentation, no batch mixing), or None without calibration. Every process reads the same batches."""
    if config.calibration is None:
        return None
    order = epoch_batches(len(train_set), config, False, torch.Generator().manual_seed(config.seed))
    if len(order) < config.calibration:
        raise ConfigError(f"calibration asks for {config.calibration} batches; the training set gives "
                              f"{len(order)} of {config.batch_size}")
    return batches_of(train_set, order[:config.calibration], device, workers=config.workers)


def _create_from_file(architecture: str, kwargs: dict[str, Any], path: Path) -> nn.Module:
    """The model with timm's loading of a weights file; timm drops the file's classifier when the class count the
    file holds differs from the model's."""
    timm = timm_with_models()
    if not path.is_file():
        raise CheckpointError(f"init_from: no weights file at {path}")
    cfg = timm.models.get_pretrained_cfg(architecture)
    classifier = _classifier(cfg.to_dict() if cfg is not None else {})
    try:
        weights = timm.models.load_state_dict(str(path))
    except Exception as e:  # torch.load and safetensors raise many types for a foreign file
        raise CheckpointError(f"cannot read weights file {path} ({type(e).__name__}: {e})") from e
    head = weights.get(classifier + ".weight")
    overlay = {"file": str(path), "num_classes": kwargs.get("num_classes") if head is None else head.shape[0]}
    try:
        model = timm.create_model(architecture, pretrained=True, pretrained_cfg_overlay=overlay, **kwargs)
    except (RuntimeError, KeyError, ValueError) as e:
        raise CheckpointError(f"{path}: weights do not fit {architecture}: {e}") from e
    # timm loads non-strictly once it drops a classifier: a tensor the file lacks would stay as initialised. (A file
    # whose names timm's filter rewrites shares none with the model, and timm checked it.)
    own = model.state_dict()
    unfilled = [k for k in own if k not in weights and not k.startswith(classifier + ".")]
    if unfilled and own.keys() & weights.keys():
        raise CheckpointError(f"{path}: weights do not fit {architecture} (the file lacks {unfilled[:5]})")
    return model


def _classifier(pretrained_cfg: dict[str, Any]) -> str:
    """The classifier's module name in a timm pretrained config (the first of several)."""
    name = pretrained_cfg.get("classifier", "head")
    return name[0] if isinstance(name, (tuple, list)) else name
