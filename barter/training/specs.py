"""What each data set is (classes, channels, native size, normalisation, default recipe) and the names of the
data sets and recipes: read by `TrainConfig` and the `barter` command's parser without importing torch or
loading anything (`barter.training.data` builds the data sets from them)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Recipe = Literal["cct", "vit", "light", "none"]
RECIPES: tuple[Recipe, ...] = ("cct", "vit", "light", "none")


@dataclass(frozen=True)
class DatasetSpec:
    """What a data set is: classes, channels, native image size, normalisation and default recipe."""

    name: str
    num_classes: int
    in_chans: int
    img_size: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    recipe: Recipe
    hflip: bool
    sizes: tuple[tuple[tuple[int, int], int], ...] = ()  # a folder's (width, height) counts, most common first


SPECS: dict[str, DatasetSpec] = {
    spec.name: spec for spec in (
        DatasetSpec("cifar100", 100, 3, 32, (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762), "cct", True),
        DatasetSpec("tiny-imagenet", 200, 3, 64, (0.4802, 0.4481, 0.3975), (0.2302, 0.2265, 0.2262), "vit", True),
        DatasetSpec("mnist5k", 10, 1, 32, (0.1307,), (0.3081,), "light", False),
        DatasetSpec("fake", 10, 3, 32, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5), "light", True),
    )
}
FOLDER = "folder"  # a data set whose spec is read from its files (`barter.training.data.folder_spec`)
DATASETS: tuple[str, ...] = (*SPECS, FOLDER)
READS_NO_FILES: tuple[str, ...] = ("mnist5k", "fake")  # data sets that never read data_dir


def is_folder_tree(root: str | os.PathLike[str]) -> bool:
    """Whether ``root`` is laid out as a ``folder`` data set: ``train/`` beside ``val/`` (or ``test/``)."""
    root = Path(root)
    return (root / "train").is_dir() and ((root / "val").is_dir() or (root / "test").is_dir())
