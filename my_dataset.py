"""The image dataset, its uint8 transforms, the normalisation done on the device, the crop
done on the device for the whole batch (--device-augment), and the sampler that makes
augmentation reproducible. Knows nothing of processes or launchers."""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import random
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from PIL import Image
from torch.utils.data import Dataset, DistributedSampler, Sampler
from torchvision.io import ImageReadMode, decode_jpeg, read_file
from torchvision.transforms import RandomResizedCrop, v2
from torchvision.transforms.v2.functional import pil_to_tensor

from utils import DataSplit, Sample, load_rgb

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# The random resized crop's smallest share of the picture (ImageNet's 0.08, --crop-scale) and its
# range of aspect ratios (torchvision's defaults), shared by the loader's transform and the
# draws of --device-augment, which must cut the same boxes.
CROP_SCALE = 0.08
CROP_RATIO = (3 / 4, 4 / 3)


def eval_resize(img_size: int) -> int:
    return round(img_size / 0.875)  # 224 -> 256, the usual ImageNet evaluation ratio


def cache_short_side(config: Mapping[str, Any]) -> int:
    """The short side --cache keeps each picture at: enough for training's crops and evaluation's."""
    return max(eval_resize(config["img_size"]), eval_resize(eval_img_size(config)))


def decode(path: str, min_size: int) -> torch.Tensor:
    """An upright RGB picture as a uint8 CHW tensor, by the fastest way for this file (`python -m
    benchmarks data`): torchvision's decode_jpeg for a JPEG of about the size needed, PIL's draft
    mode for one twice as large or more (decoded at 1/2 to 1/8 scale), PIL for anything else."""
    with Image.open(path) as img:  # reads the header only
        small_jpeg = img.format == "JPEG" and min(img.size) < 2 * min_size
    if small_jpeg:
        with contextlib.suppress(RuntimeError):  # a JPEG libjpeg refuses: PIL's then
            return decode_jpeg(read_file(path), mode=ImageReadMode.RGB, apply_exif_orientation=True)
    return pil_to_tensor(load_rgb(path, min_size))


AUTO_AUGMENT = {"none": None, "ta_wide": v2.TrivialAugmentWide, "ra": v2.RandAugment, "augmix": v2.AugMix}


@dataclasses.dataclass(frozen=True)
class Augmentation:
    """The training augmentation beyond the random crop and flip: torchvision.transforms.v2's
    own policies, as torchvision's classification references apply them."""

    auto_augment: str = "none"  # a key of AUTO_AUGMENT
    random_erase: float = 0.0  # probability of erasing one rectangle per image
    crop_scale: float = CROP_SCALE  # the random crop's smallest share of the picture's area
    flip: str = "random"  # "random": each image, each epoch; "alternate": see alternate_flip()


def build_transform(img_size: int, train: bool, augmentation: Augmentation = Augmentation()) -> v2.Compose:
    """uint8 tensors (or PIL images) to uint8 CHW tensors of `img_size`: the float conversion and
    normalisation wait for `normalize`, on the device, so a worker hands over a quarter of the bytes."""
    if not train:
        geometry = [v2.Resize(eval_resize(img_size), antialias=True), v2.CenterCrop(img_size)]
        return v2.Compose([v2.PILToTensor(), *geometry])  # PILToTensor: PIL input only, tensors pass through
    steps = [v2.PILToTensor(), v2.RandomResizedCrop(img_size, (augmentation.crop_scale, 1.0), CROP_RATIO, antialias=True)]
    if augmentation.flip == "random":  # alternating flips need the epoch: MyDataSet makes them
        steps.append(v2.RandomHorizontalFlip())
    policy = AUTO_AUGMENT[augmentation.auto_augment]
    if policy is not None:
        steps.append(policy())
    if augmentation.random_erase > 0:  # with the mean colour, as the references' 0 after normalising is
        steps.append(v2.RandomErasing(augmentation.random_erase, value=[round(255 * m) for m in IMAGENET_MEAN]))
    return v2.Compose(steps)


@dataclasses.dataclass(frozen=True)
class SizeSchedule:
    """The training crop of each epoch (progressive resizing, as FFCV's ResNet recipes do it):
    `low` px in epoch 1, growing linearly to `high` by epoch `ramp_epochs`, `high` from then on.
    A smaller crop costs quadratically fewer operations per image. Sizes are multiples of 16,
    so a ramp uses a few distinct shapes (each one an autotuning or a compilation)."""

    low: int
    high: int
    ramp_epochs: int = 0

    def __call__(self, epoch: int) -> int:
        if epoch >= self.ramp_epochs or self.low >= self.high:
            return self.high
        size = self.low + (self.high - self.low) * (epoch - 1) / (self.ramp_epochs - 1)
        return min(self.high, 16 * round(size / 16))


class TrainTransforms:
    """Epoch -> the training transform of that epoch, its crop size following `sizes`; each
    size's transform is built on first use."""

    def __init__(self, sizes: SizeSchedule, augmentation: Augmentation = Augmentation()):
        self.sizes = sizes
        self.augmentation = augmentation
        self.built: dict[int, v2.Compose] = {}

    def __call__(self, epoch: int, size: int | None = None) -> v2.Compose:
        """The transform of `epoch`, or of crop `size` where the key carries it (--time-budget's sizes)."""
        size = size or self.sizes(epoch)
        if size not in self.built:
            self.built[size] = build_transform(size, train=True, augmentation=self.augmentation)
        return self.built[size]


def size_schedule(config: Mapping[str, Any]) -> SizeSchedule:
    """Each epoch's training crop size, as a run's configuration (its args, or a checkpoint's) asks."""
    return SizeSchedule(config.get("min_img_size") or config["img_size"], config["img_size"],
                        config.get("ramp_epochs", 0))


def train_transforms(config: Mapping[str, Any]) -> TrainTransforms:
    """Each epoch's training transform, as a run's configuration asks: the crop size of the
    epoch and the augmentation."""
    return TrainTransforms(size_schedule(config),
                           Augmentation(config.get("auto_augment", "none"), config.get("random_erase", 0.0),
                                        config.get("crop_scale", CROP_SCALE), config.get("flip", "random")))


def eval_img_size(config: Mapping[str, Any]) -> int:
    """The size a run's model is evaluated at, from its configuration (args, or a checkpoint's)."""
    return config.get("val_img_size") or config["img_size"]


@functools.cache
def _normalize_affine(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    # Made once per device: building them at every batch would be a host-to-GPU copy per step.
    mean, std = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1), torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    return (1 / (255 * std)).to(device), (-mean / std).to(device)


def normalize(images: torch.Tensor) -> torch.Tensor:
    """A uint8 batch as the model takes it: float32 (x / 255 - mean) / std, ImageNet's mean and
    std, on its device and in its memory format (a float batch of 0-255 values: in place)."""
    scale, shift = _normalize_affine(images.device)
    return images.float().mul_(scale).add_(shift)


class ImageFiles(Dataset):
    """(image, error) per path; a file that does not decode gives a blank image and the
    reason, so one bad file is reported instead of stopping the whole loader."""

    def __init__(self, paths: list[str], img_size: int):
        self.paths = paths
        self.img_size = img_size
        self.transform = build_transform(img_size, train=False)

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, str]:
        try:
            return self.transform(decode(self.paths[index], eval_resize(self.img_size))), ""
        except Exception as e:  # noqa: BLE001 -- PIL raises OSError, SyntaxError, DecompressionBombError...
            return torch.zeros(3, self.img_size, self.img_size, dtype=torch.uint8), f"{type(e).__name__}: {e}"


def default_workers(device: torch.device, cpus: int) -> int:
    """Loader workers for a process of `cpus` CPUs: all but one for a GPU, which trains thousands of images
    a second (a core decodes 900); on the CPU, a few to stay ahead of the step (performance.md)."""
    return max(1, cpus - 1 if device.type == "cuda" else min(8, cpus - 1))


def train_and_val_sets(split: DataSplit, args: Any) -> tuple[MyDataSet, MyDataSet]:
    """The training images with their random crops and flips (each epoch's crop size, under
    progressive resizing), the validation images resized and centre-cropped, as `args` ask."""
    augmentation = Augmentation(args.auto_augment, args.random_erase, args.crop_scale, args.flip)
    train = (train_transforms(vars(args)) if args.min_img_size
             else build_transform(args.img_size, train=True, augmentation=augmentation))
    val_size = eval_img_size(vars(args))
    return (MyDataSet(split.train, train, args.img_size, args.seed, alternate_flip=args.flip == "alternate"),
            MyDataSet(split.val, build_transform(val_size, train=False), eval_resize(val_size)))


class PixelCache(Protocol):
    """Decoded pictures by path (multi_train_utils.loaders.SharedImageCache)."""

    def get(self, path: str) -> torch.Tensor: ...


class MyDataSet(Dataset):
    """(image, label) pairs from a list of (path, label).

    A key is an index, or an (epoch, index) pair from `EpochKeys` (or an (epoch, index, crop
    size) triple), whose random augmentation is seeded by (seed, epoch, index): the same image
    gets the same crop in the same epoch whatever the world size, the number of loader workers,
    or whether the run was resumed, which is what makes resumed and repeated runs exact. A
    `transform` that is a TrainTransforms gives each epoch's (progressive resizing).
    """

    def __init__(self, samples: Sequence[Sample], transform: v2.Compose | TrainTransforms, min_size: int,
                 seed: int = 0, cache: PixelCache | None = None, alternate_flip: bool = False):
        self.samples, self.transform, self.min_size, self.seed = list(samples), transform, min_size, seed
        self.cache, self.alternate_flip = cache, alternate_flip

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, key: int | tuple[int, ...]) -> tuple[torch.Tensor, int]:
        epoch, index, *size = key if isinstance(key, tuple) else (None, key)
        path, label = self.samples[index]
        try:
            img = self.cache.get(path) if self.cache is not None else decode(path, self.min_size)
        except Exception as e:
            raise RuntimeError(f"cannot decode {path}: {e} (--check-images leaves out the files that do not decode)") from e
        transform = self.transform
        if isinstance(transform, TrainTransforms):
            transform = transform(epoch or 1, *size)
        if epoch is None:
            return transform(img), label
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(image_seed(self.seed, epoch, index))
            img = transform(img)
        # Last, after any policy: a mirror commutes in distribution with the crop, the
        # policies' operations and the erasing, which all draw both ways alike.
        if self.alternate_flip and alternate_flip(self.seed, epoch, index):
            img = v2.functional.horizontal_flip(img)
        return img, label


def image_seed(seed: int, epoch: int, index: int) -> int:
    """The seed of one image's augmentation in one epoch."""
    return (seed * 1_000_003 + epoch) * 1_000_003 + index


def alternate_flip(seed: int, epoch: int, index: int) -> bool:
    """--flip alternate (Jordan 2024, arXiv:2404.00498): whether an image is mirrored in an
    epoch. Epoch 1 draws at random, each image its own coin (seeded by the run's seed and
    the image); every later epoch mirrors exactly the images the epoch before did not, so
    each pair of epochs shows every image both ways, where independent coins show half of them
    one way only."""
    first = random.Random(image_seed(seed, 0, index)).random() < 0.5
    return first != (epoch % 2 == 0)


class CropDraws(Dataset):
    """The random part of the training transform alone, for --device-augment: per (epoch,
    index) key, the crop box and flip that MyDataSet's transform draws for that image (the same
    seed, the same calls in the same order), in the frame `shapes[index]` = (height, width) of
    the picture, as the row [index, top, left, height, width, flip]; and the label. Drawing is
    all a loader worker does here: the pixels wait on the device, in `DeviceCrops`."""

    def __init__(self, samples: Sequence[Sample], shapes: Sequence[tuple[int, int]], seed: int = 0,
                 crop_scale: float = CROP_SCALE, flip: str = "random"):
        self.labels = [label for _, label in samples]
        self.shapes = list(shapes)
        self.seed = seed
        self.crop_scale = crop_scale
        self.flip = flip

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, key: tuple[int, ...]) -> tuple[torch.Tensor, int]:
        epoch, index = key[:2]  # a crop size after them is DeviceCrops' business
        frame = torch.empty(0, *self.shapes[index])  # only its size is read
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(image_seed(self.seed, epoch, index))
            top, left, height, width = RandomResizedCrop.get_params(frame, [self.crop_scale, 1.0], list(CROP_RATIO))
            # v2.RandomHorizontalFlip's draw (flip when below p); --flip alternate draws nothing here
            flip = torch.rand(1).item() < 0.5 if self.flip == "random" else alternate_flip(self.seed, epoch, index)
        return torch.tensor([index, top, left, height, width, int(flip)]), self.labels[index]


class DeviceCrops:
    """The training images, decoded once, on the training device: `pixels` (N, 3, S, S) uint8,
    each picture resized to the square whatever its shape, and `frames` (N, 2), the (height,
    width) its crop boxes are drawn in. A batch of draws becomes a batch of crops in one
    affine_grid/grid_sample call, every image with its own box and flip.

    The square stretches a picture; a box is taken as a fraction of the picture's height and
    width, which the stretch keeps, so the crop shows what the loader's crop shows. It differs
    in resampling only: bilinear from S px (the loader resizes with antialiasing from the
    picture itself), and floats not rounded to bytes.
    """

    def __init__(self, pixels: torch.Tensor, frames: torch.Tensor):
        self.pixels = pixels
        self.frames = frames.to(pixels.device)

    def __call__(self, draws: torch.Tensor, size: int) -> torch.Tensor:
        """Normalised float images (B, 3, size, size) for rows of CropDraws, on the pixels' device."""
        draws = draws.to(self.pixels.device, non_blocking=True)
        index = draws[:, 0]
        top, left, height, width, flip = draws[:, 1:].float().unbind(1)
        frame_h, frame_w = self.frames[index].float().unbind(1)
        # Output x in [-1, 1] (grid_sample's align_corners=False, pixel centres) maps to the box's
        # span of the picture in the same convention: x * width/W + (2 left + width)/W - 1.
        scale_x = torch.where(flip.bool(), -width, width) / frame_w
        zeros = torch.zeros_like(scale_x)
        theta = torch.stack([
            torch.stack([scale_x, zeros, (2 * left + width) / frame_w - 1], 1),
            torch.stack([zeros, height / frame_h, (2 * top + height) / frame_h - 1], 1),
        ], 1)
        grid = F.affine_grid(theta, [len(draws), 3, size, size], align_corners=False)
        # "border": a box on the picture's edge samples the edge pixels, as the loader's crop does.
        crops = F.grid_sample(self.pixels[index].float(), grid, mode="bilinear", padding_mode="border",
                              align_corners=False)
        return normalize(crops)


class EpochKeys(Sampler[tuple[int, int]]):
    """The indices of a DistributedSampler (or any sampler with an `epoch`, which its
    set_epoch() sets) as (epoch, index) keys, for `MyDataSet`'s seeding: a loader worker, forked
    once, learns each epoch from its keys. A resumed epoch's pass begins after the samples a
    stopped run trained on (`skip_next_pass`)."""

    def __init__(self, sampler: DistributedSampler):
        self.sampler, self.skip = sampler, 0
        # Set by --time-budget once it knows the epoch count: the keys carry each epoch's crop size to the workers.
        self.sizes: SizeSchedule | None = None

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def skip_next_pass(self, samples: int) -> None:
        """The next pass leaves out its first `samples` indices (those trained before a stop)."""
        self.skip = samples

    def __iter__(self) -> Iterator[tuple[int, ...]]:
        skip, self.skip = self.skip, 0
        epoch, indices = self.epoch, itertools.islice(self.sampler, skip, None)
        return ((epoch, i) if self.sizes is None else (epoch, i, self.sizes(epoch)) for i in indices)

    def __len__(self) -> int:
        return max(0, len(self.sampler) - self.skip)
