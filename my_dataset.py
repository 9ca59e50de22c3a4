"""The image dataset, its transforms, and the sampler that makes augmentation reproducible."""
from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch.utils.data import Dataset, DistributedSampler, Sampler
from torchvision.transforms import v2

from utils import Sample, load_rgb

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def eval_resize(img_size: int) -> int:
    return round(img_size / 0.875)  # 224 -> 256, the usual ImageNet evaluation ratio


def build_transform(img_size: int, train: bool) -> v2.Compose:
    # Crop and resize run on the PIL image, before the float conversion, so they touch
    # one byte per channel on a small picture instead of four on a large one.
    if train:
        geometry = [v2.RandomResizedCrop(img_size, antialias=True), v2.RandomHorizontalFlip()]
    else:
        geometry = [v2.Resize(eval_resize(img_size), antialias=True), v2.CenterCrop(img_size)]
    return v2.Compose(
        [
            *geometry,
            v2.PILToTensor(),
            v2.ToDtype(torch.float32, scale=True),
            v2.Normalize(IMAGENET_MEAN, IMAGENET_STD),
        ]
    )


class MyDataSet(Dataset):
    """(image, label) pairs from a list of (path, label).

    A key is either an index or an (epoch, index) pair from `EpochSampler`. For a pair, the
    random augmentation is seeded by (seed, epoch, index): the same image gets the same crop
    in the same epoch whatever the world size, the number of loader workers, or whether the
    run was resumed, which is what makes resumed and repeated runs exact.
    """

    def __init__(self, samples: Sequence[Sample], transform: v2.Compose, min_size: int, seed: int = 0):
        self.samples = list(samples)
        self.transform = transform
        self.min_size = min_size
        self.seed = seed

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, key: int | tuple[int, int]) -> tuple[torch.Tensor, int]:
        epoch, index = key if isinstance(key, tuple) else (None, key)
        path, label = self.samples[index]
        try:
            img = load_rgb(path, self.min_size)
        except Exception as e:
            # Unreadable files were left out at start-up; this one changed since.
            raise RuntimeError(f"cannot decode {path}: {e}") from e
        if epoch is None:
            return self.transform(img), label
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed((self.seed * 1_000_003 + epoch) * 1_000_003 + index)
            return self.transform(img), label


class EpochSampler(Sampler[tuple[int, int]]):
    """A DistributedSampler whose indices carry the epoch, for `MyDataSet`'s seeding."""

    def __init__(self, sampler: DistributedSampler):
        self.sampler = sampler
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return ((self.epoch, i) for i in self.sampler)

    def __len__(self) -> int:
        return len(self.sampler)
