"""Data loading from the real on-disk layouts (written here as tiny fixtures), MNIST-5k, fake data, recipes."""

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from timm.data.random_erasing import RandomErasing

from barter.training.data import (
    DatasetNotFoundError,
    build_datasets,
    build_mixup,
    build_train_transform,
    load_mnist5k,
    resolve_spec,
    size_note,
)


def _write_cifar100(root: Path, n_train: int = 6, n_test: int = 4) -> dict[str, np.ndarray]:
    """The python-version CIFAR-100 files: pickled dicts with rows of 3072 bytes (R, G, B planes of 32x32)."""
    folder = root / "cifar-100-python"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    arrays = {}
    for split, n in (("train", n_train), ("test", n_test)):
        data = rng.integers(0, 256, size=(n, 3072), dtype=np.uint8)
        entry = {"filenames": [f"{split}_{i}.png" for i in range(n)], "data": data,
                 "fine_labels": [(7 * i) % 100 for i in range(n)], "coarse_labels": [i % 20 for i in range(n)]}
        (folder / split).write_bytes(pickle.dumps(entry, protocol=2))
        arrays[split] = data
    meta = {"fine_label_names": [f"class{i}" for i in range(100)],
            "coarse_label_names": [f"super{i}" for i in range(20)]}
    (folder / "meta").write_bytes(pickle.dumps(meta, protocol=2))
    return arrays


def _write_tiny_imagenet(root: Path) -> None:
    """wnids.txt, train/<wnid>/images/*.JPEG (+ the boxes file), val/images/*.JPEG, val/val_annotations.txt."""
    base = root / "tiny-imagenet-200"
    wnids = ["n02", "n01"]  # unsorted on purpose: classes are indexed in sorted order
    (base / "wnids.txt").parent.mkdir(parents=True)
    (base / "wnids.txt").write_text("\n".join(wnids) + "\n")
    for w, wnid in enumerate(wnids):
        images = base / "train" / wnid / "images"
        images.mkdir(parents=True)
        for i in range(3):
            Image.new("RGB", (64, 64), (40 * w, 10 * i, 0)).save(images / f"{wnid}_{i}.JPEG")
        (base / "train" / wnid / f"{wnid}_boxes.txt").write_text(f"{wnid}_0.JPEG\t0\t0\t10\t10\n")
    (base / "val" / "images").mkdir(parents=True)
    Image.new("L", (64, 64), 128).save(base / "val" / "images" / "val_0.JPEG")  # some are grey in the real set
    Image.new("RGB", (64, 64), (1, 2, 3)).save(base / "val" / "images" / "val_1.JPEG")
    (base / "val" / "val_annotations.txt").write_text("val_0.JPEG\tn02\t0\t0\t5\t5\nval_1.JPEG\tn01\t1\t1\t9\t9\n")


def test_cifar100_layout(tmp_path: Path) -> None:
    arrays = _write_cifar100(tmp_path)
    data = build_datasets("cifar100", tmp_path)
    assert (len(data.train), len(data.test)) == (6, 4)
    assert (data.num_classes, data.in_chans, data.img_size) == (100, 3, 32)
    assert data.test.targets == [0, 7, 14, 21] and data.test.classes[7] == "class7"
    expected = arrays["test"][1].reshape(3, 32, 32).transpose(1, 2, 0)
    assert np.array_equal(data.test.images[1].permute(1, 2, 0).numpy(), expected)  # decoded once, (C, H, W)
    image, label = data.train[2]
    assert image.shape == (3, 32, 32) and image.dtype == torch.float32 and label == 14


def test_tiny_imagenet_layout(tmp_path: Path) -> None:
    _write_tiny_imagenet(tmp_path)
    data = build_datasets("tiny-imagenet", tmp_path, recipe="none")
    assert (len(data.train), len(data.test)) == (6, 2)
    assert (data.num_classes, data.in_chans, data.img_size) == (2, 3, 64)  # the classes of wnids.txt
    assert sorted(set(data.train.targets)) == [0, 1]
    assert all(Path(p).parent.parent.name == ("n01", "n02")[t] for p, t in data.train.samples)
    assert [label for _, label in (data.test[0], data.test[1])] == [1, 0]
    assert data.test[0][0].shape == (3, 64, 64)  # grey JPEG read as RGB
    assert build_datasets("tiny-imagenet", tmp_path / "tiny-imagenet-200").train.targets == data.train.targets


def test_mnist5k_split() -> None:
    x_train, y_train, x_test, y_test = load_mnist5k()
    assert x_train.shape == (4000, 32, 32) and x_test.shape == (1000, 32, 32)
    assert x_train.dtype == np.uint8 and x_train.max() == 255
    assert np.bincount(y_train).tolist() == [400] * 10 and np.bincount(y_test).tolist() == [100] * 10
    assert not x_train[:, :2].any() and not x_train[:, :, -2:].any()  # 28x28 digits padded by 2
    data = build_datasets("mnist5k")
    assert (len(data.train), len(data.test), data.num_classes, data.in_chans, data.img_size) == (4000, 1000, 10, 1, 32)
    image, label = data.test[0]
    assert image.shape == (1, 32, 32) and 0 <= label <= 9
    assert build_datasets("mnist5k", in_chans=3).train[0][0].shape == (3, 32, 32)


def test_fake_is_deterministic() -> None:
    data = build_datasets("fake", fake_size=8, recipe="none")
    assert (len(data.train), len(data.test)) == (8, 2)
    first, again = data.train[3], data.train[3]
    assert torch.equal(first[0], again[0]) and first[1] == again[1]
    assert not torch.equal(data.test[0][0], data.train[0][0])
    assert build_datasets("fake", img_size=64, in_chans=1, fake_size=4).train[0][0].shape == (1, 64, 64)


@pytest.mark.parametrize("name,where", [("cifar100", "cifar-100-python"), ("tiny-imagenet", "tiny-imagenet-200")])
def test_missing_data_says_what_to_put_where(tmp_path: Path, name: str, where: str) -> None:
    with pytest.raises(DatasetNotFoundError, match=where) as info:
        build_datasets(name, tmp_path / "nowhere")
    assert isinstance(info.value, FileNotFoundError) and "--data-dir" in str(info.value)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="unknown dataset"):
        build_datasets("imagenet")
    with pytest.raises(ValueError, match="channel"):
        resolve_spec("cifar100", in_chans=1)


def test_recipes() -> None:
    spec = resolve_spec("cifar100")
    names = lambda recipe: [type(t).__name__ for t in build_train_transform(spec, recipe).transforms]  # noqa: E731
    assert names("cct")[:3] == ["RandomCrop", "RandomHorizontalFlip", "RandAugment"]
    assert names("vit")[:3] == ["RandomCrop", "RandomHorizontalFlip", "AutoAugment"]
    vit = build_train_transform(spec, "vit").transforms
    assert isinstance(vit[-1], RandomErasing) and vit[-1].probability == 0.25
    assert build_train_transform(spec, "vit").transforms[0].padding == 4
    mnist = build_train_transform(resolve_spec("mnist5k"))
    assert [type(t).__name__ for t in mnist.transforms] == ["RandomCrop", "ToTensor", "Normalize"]
    assert mnist.transforms[0].padding == 2
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8))
    for recipe in ("cct", "vit", "light", "none"):
        assert build_train_transform(spec, recipe)(image).shape == (3, 32, 32)


def test_mixup_factory() -> None:
    assert build_mixup("light", 10) is None and build_mixup("none", 10) is None
    cct, vit = build_mixup("cct", 10), build_mixup("vit", 10)
    assert cct.cutmix_alpha == 0.0 and cct.mixup_alpha > 0
    assert vit.cutmix_alpha > 0 and vit.mixup_alpha > 0 and vit.switch_prob == 0.5
    images, targets = vit(torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 2, 3]))
    assert images.shape == (4, 3, 32, 32) and targets.shape == (4, 10)
    assert torch.allclose(targets.sum(1), torch.ones(4))


def _write_folder(root: Path, train: dict[str, int], val: dict[str, int], size: tuple[int, int] = (12, 12),
                  mode: str = "RGB") -> Path:
    """DIR/train/<class>/*.png and DIR/val/<class>/*.png with the given image counts per class."""
    for split, counts in (("train", train), ("val", val)):
        for c, (name, n) in enumerate(counts.items()):
            folder = root / split / name
            folder.mkdir(parents=True)
            for i in range(n):
                Image.new(mode, size, (30 * c, 10 * i, 0) if mode == "RGB" else 20 * c + i).save(folder / f"{i}.png")
    return root


def test_image_folder_reads_classes_channels_and_size(tmp_path: Path) -> None:
    root = _write_folder(tmp_path, {"cat": 2, "dog": 3, "emu": 1}, {"dog": 1, "cat": 1})
    data = build_datasets("folder", root)
    assert (data.num_classes, data.in_chans, data.img_size, len(data.train), len(data.test)) == (3, 3, 12, 6, 2)
    assert sorted(data.test.targets) == [0, 1]  # val labels follow the training tree's classes
    image, label = data.train[5]
    assert image.shape == (3, 12, 12) and label == 2
    assert build_datasets("folder", root, img_size=8, in_chans=1).test[0][0].shape == (1, 8, 8)


def test_image_folder_of_grey_non_square_images(tmp_path: Path) -> None:
    root = _write_folder(tmp_path, {"a": 1, "b": 1}, {"a": 1}, size=(20, 10), mode="L")
    data = build_datasets("folder", root)
    assert (data.in_chans, data.img_size) == (1, 10) and data.train[0][0].shape == (1, 10, 10)


def test_image_folder_of_mixed_sizes_trains_at_the_most_common(tmp_path: Path) -> None:
    root = _write_folder(tmp_path, {"a": 2, "b": 2}, {"a": 1}, size=(16, 16))
    Image.new("L", (6, 6), 200).save(root / "train" / "a" / "0.png")  # first in sort order, grey, 6 px
    data = build_datasets("folder", root)
    assert (data.img_size, data.in_chans) == (16, 3)
    assert data.train[0][0].shape == data.train[3][0].shape == (3, 16, 16)
    note = size_note(resolve_spec("folder", data_dir=root))
    assert "2 image sizes among the 4 read (16x16: 3, 6x6: 1)" in note and "the most common size" in note
    assert "resized to 8 px" in size_note(resolve_spec("folder", img_size=8, data_dir=root))
    assert size_note(resolve_spec("folder", data_dir=_write_folder(tmp_path / "one", {"a": 1, "b": 1}, {}))) is None


@pytest.mark.parametrize("train,val,message", [
    (None, None, "no .*train/"),
    ({}, {"a": 1}, "has no class folders"),
    ({"a": 1, "b": 1}, {"c": 1}, "classes the training tree lacks: c"),
    ({"a": 1, "b": 0}, {"a": 1}, "no images for class"),
    ({"a": 1, "b": 1}, {"a": 0, "b": 0}, "no images in"),
    ({"a": 2}, {"a": 1}, "has one class folder \\(a\\); a classifier needs two or more"),
])
def test_image_folder_errors(tmp_path: Path, train, val, message) -> None:
    if train is not None:
        _write_folder(tmp_path, train, val)
        for split in ("train", "val"):
            (tmp_path / split).mkdir(exist_ok=True)
    with pytest.raises(DatasetNotFoundError, match=message):
        build_datasets("folder", tmp_path)
