"""In-memory image sets decoded once into one uint8 tensor, whose recipe runs on whole batches on the device.

A recipe made of random crops, horizontal flips and normalisation (``light`` and ``none``: see
`barter.training.data`) needs no per-image PIL work: the deterministic part (decoding, resizing) runs once when
the set is built, and the random part runs on a batch of uint8 images where the model lives, with every image's
crop offsets and flip drawn from the process's torch stream (seeded per rank and epoch by
`barter.training.processes`, saved in checkpoints), so runs stay reproducible and resumable.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image
from torch import Tensor
from torch.utils.data import Dataset
from torchvision import transforms as T


@dataclass(frozen=True)
class BatchTransform:
    """RandomCrop(size, padding) with zero fill, RandomHorizontalFlip and ToTensor + Normalize of torchvision,
    for a batch of uint8 images (B, C, H, W) on any device, each image with its own draws."""

    mean: tuple[float, ...]
    std: tuple[float, ...]
    padding: int = 0
    hflip: bool = False

    def __call__(self, images: Tensor) -> Tensor:
        if self.padding:
            images = self._crop(images)
        if self.hflip:
            flip = (torch.rand(len(images)) < 0.5).to(images.device)
            images = torch.where(flip[:, None, None, None], images.flip(-1), images)
        mean = torch.tensor(self.mean, device=images.device).view(1, -1, 1, 1)
        std = torch.tensor(self.std, device=images.device).view(1, -1, 1, 1)
        return images.float().div_(255).sub_(mean).div_(std)

    def _crop(self, images: Tensor) -> Tensor:
        """An (H, W) window of each zero-padded image at offsets drawn uniformly in [0, 2 * padding]."""
        batch, _, height, width = images.shape
        span = 2 * self.padding + 1
        top, left = (torch.randint(0, span, (batch,)).to(images.device) for _ in range(2))
        padded = torch.nn.functional.pad(images, (self.padding,) * 4).permute(0, 2, 3, 1)
        rows = (top[:, None] + torch.arange(height, device=images.device))[:, :, None]
        cols = (left[:, None] + torch.arange(width, device=images.device))[:, None, :]
        return padded[torch.arange(batch, device=images.device)[:, None, None], rows, cols].permute(0, 3, 1, 2)


class TensorImages(Dataset):
    """Images held as one uint8 tensor (N, C, H, W) with their labels; `batch` gathers and transforms a whole
    batch on a device, indexing gives one transformed image (for code that loads image by image)."""

    def __init__(self, images: Tensor, targets: Sequence[int], transform: BatchTransform,
                 classes: list[str] | None = None) -> None:
        if images.dtype != torch.uint8 or images.dim() != 4 or len(images) != len(targets):
            raise ValueError(f"TensorImages needs uint8 images (N, C, H, W) and N labels, got "
                             f"{images.dtype} {tuple(images.shape)} and {len(targets)} labels")
        self.images = images
        self.targets = list(targets)
        self.labels = torch.as_tensor(self.targets, dtype=torch.long)
        self.transform = transform
        self.classes = classes

    def __getitem__(self, index: int) -> tuple[Tensor, int]:
        return self.transform(self.images[index:index + 1])[0], self.targets[index]

    def __len__(self) -> int:
        return len(self.targets)

    def batch(self, indices: Sequence[int], device: torch.device) -> tuple[Tensor, Tensor]:
        """The transformed images and the labels of `indices`, on `device`."""
        index = torch.as_tensor(indices, dtype=torch.long)
        images = self.images[index].to(device, non_blocking=True)
        return self.transform(images), self.labels[index].to(device, non_blocking=True)


def decode(images: Iterable[Image.Image], mode: str, resize: list) -> Tensor:
    """PIL images in `mode` ("L" or "RGB") through the `resize` steps (PIL transforms), as uint8 (N, C, H, W)."""
    prepare = T.Compose(resize)
    arrays = [np.asarray(prepare(image.convert(mode))) for image in images]
    stacked = torch.from_numpy(np.stack(arrays))
    return stacked[:, None] if stacked.dim() == 3 else stacked.permute(0, 3, 1, 2).contiguous()
