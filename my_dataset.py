"""The image dataset, its transforms, the shared-memory image cache, and the sampler that
makes augmentation reproducible."""
from __future__ import annotations

import functools
import mmap
import os
import secrets
import shutil
import sys
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import torch.distributed as dist
from PIL import Image
from torch.utils.data import Dataset, DistributedSampler, Sampler
from torchvision.io import ImageReadMode, decode_jpeg, read_file
from torchvision.transforms import v2
from torchvision.transforms.v2.functional import pil_to_tensor

from multi_train_utils.distributed_utils import DistContext, broadcast_object
from utils import Sample, UserError, load_rgb

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def eval_resize(img_size: int) -> int:
    return round(img_size / 0.875)  # 224 -> 256, the usual ImageNet evaluation ratio


def decode(path: str, min_size: int) -> torch.Tensor:
    """An upright RGB picture as a uint8 CHW tensor, by the fastest way for this file.

    Measured by `benchmark.py data` (README, Performance): torchvision's decode_jpeg reads
    flower-sized JPEGs faster than PIL; a JPEG at least twice the size needed is cheaper
    still through PIL's draft mode, which decodes it at 1/2 to 1/8 scale. Everything else,
    and any JPEG that libjpeg refuses, goes through PIL.
    """
    with Image.open(path) as img:  # reads the header only
        small_jpeg = img.format == "JPEG" and min(img.size) < 2 * min_size
    if small_jpeg:
        try:
            return decode_jpeg(read_file(path), mode=ImageReadMode.RGB, apply_exif_orientation=True)
        except RuntimeError:
            pass
    return pil_to_tensor(load_rgb(path, min_size))


def build_transform(img_size: int, train: bool) -> v2.Compose:
    """Takes uint8 tensors (or PIL images) and gives uint8 CHW tensors of `img_size`.

    Everything here runs on one byte per channel. The float conversion and normalisation
    wait for `normalize`, on the training device, batched: a loader worker then hands over,
    and the GPU copy then moves, a quarter of the bytes of float32.
    """
    if train:
        geometry = [v2.RandomResizedCrop(img_size, antialias=True), v2.RandomHorizontalFlip()]
    else:
        geometry = [v2.Resize(eval_resize(img_size), antialias=True), v2.CenterCrop(img_size)]
    return v2.Compose([v2.PILToTensor(), *geometry])  # PILToTensor: PIL input only, tensors pass through


@functools.cache
def _normalize_affine(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    # Made once per device: building them at every batch would be a host-to-GPU copy per step.
    mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    return (1 / (255 * std)).to(device), (-mean / std).to(device)


def normalize(images: torch.Tensor) -> torch.Tensor:
    """A uint8 batch (N, 3, H, W) as the model takes it: float32, (x / 255 - mean) / std with
    ImageNet's mean and std, on the batch's device and in its memory format."""
    scale, shift = _normalize_affine(images.device)
    return images.float().mul_(scale).add_(shift)


class SharedImageCache:
    """Every image decoded once, resized to a short side of `short_side`, kept as uint8 RGB in
    one shared-memory file per machine.

    Local rank 0 creates the file in /dev/shm, every process on the machine maps it, and the
    name is removed before the (slow) decoding starts: the memory lives exactly as long as the
    processes mapping it, so a crash leaves nothing behind. Data-loader workers inherit the
    mapping when they fork, so there is one copy per machine, not one per rank or per worker.
    """

    def __init__(self, paths: Sequence[str], short_side: int, ctx: DistContext):
        if sys.platform != "linux":
            raise UserError("--cache needs Linux (a /dev/shm file shared with forked loader workers)")
        self.index = {p: i for i, p in enumerate(paths)}
        self.shapes = [_cached_shape(p, short_side) for p in paths]  # header reads only
        sizes = [h * w * 3 for h, w in self.shapes]
        self.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.nbytes = int(self.offsets[-1])
        _check_room(self.nbytes)
        token = broadcast_object(secrets.token_hex(8) if ctx.is_main else None, ctx)
        path = f"/dev/shm/imgcache-{token}-{ctx.rank - ctx.local_rank}"  # one per machine, even two "machines" on one
        creator = ctx.local_rank == 0
        if creator:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            os.ftruncate(fd, max(1, self.nbytes))
        _barrier(ctx)
        if not creator:
            fd = os.open(path, os.O_RDWR)
        self._map = mmap.mmap(fd, max(1, self.nbytes))
        os.close(fd)
        _barrier(ctx)
        if creator:
            os.unlink(path)
        self.pixels = np.frombuffer(self._map, dtype=np.uint8, count=self.nbytes)
        mine = range(ctx.local_rank, len(paths), ctx.local_world_size)
        with ThreadPoolExecutor(max_workers=torch.get_num_threads()) as pool:  # PIL releases the GIL
            list(pool.map(lambda i: self._fill(i, paths[i], short_side), mine))
        _barrier(ctx)

    def _fill(self, i: int, path: str, short_side: int) -> None:
        h, w = self.shapes[i]
        img = load_rgb(path, min_size=short_side).resize((w, h), Image.BILINEAR, reducing_gap=3.0)
        self.pixels[self.offsets[i] : self.offsets[i + 1]] = np.asarray(img).reshape(-1)

    def get(self, path: str) -> torch.Tensor:
        """The cached picture as a uint8 CHW tensor viewing the shared memory (no copy)."""
        i = self.index[path]
        h, w = self.shapes[i]
        hwc = self.pixels[self.offsets[i] : self.offsets[i + 1]].reshape(h, w, 3)
        return torch.from_numpy(hwc).permute(2, 0, 1)


def _cached_shape(path: str, short_side: int) -> tuple[int, int]:
    with Image.open(path) as img:
        w, h = img.size
        if img.getexif().get(0x0112) in (5, 6, 7, 8):  # EXIF says: rotated by 90 degrees
            w, h = h, w
    scale = short_side / min(w, h)
    return max(1, round(h * scale)), max(1, round(w * scale))


def _check_room(nbytes: int) -> None:
    shm_free = shutil.disk_usage("/dev/shm").free
    with open("/proc/meminfo") as f:
        available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    room = min(shm_free, available)
    if nbytes > 0.8 * room:  # leave room for the model, the loaders and the rest of the machine
        raise UserError(
            f"--cache needs {nbytes / 2**30:.2f} GiB of shared memory, but only {room / 2**30:.2f} GiB is "
            "available (/dev/shm or free RAM): train without --cache, or with a smaller --img-size"
        )


def _barrier(ctx: DistContext) -> None:
    if ctx.distributed:
        dist.barrier()


class MyDataSet(Dataset):
    """(image, label) pairs from a list of (path, label).

    A key is either an index or an (epoch, index) pair from `EpochSampler`. For a pair, the
    random augmentation is seeded by (seed, epoch, index): the same image gets the same crop
    in the same epoch whatever the world size, the number of loader workers, or whether the
    run was resumed, which is what makes resumed and repeated runs exact.
    """

    def __init__(self, samples: Sequence[Sample], transform: v2.Compose, min_size: int, seed: int = 0,
                 cache: SharedImageCache | None = None):
        self.samples = list(samples)
        self.transform = transform
        self.min_size = min_size
        self.seed = seed
        self.cache = cache

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, key: int | tuple[int, int]) -> tuple[torch.Tensor, int]:
        epoch, index = key if isinstance(key, tuple) else (None, key)
        path, label = self.samples[index]
        try:
            img = self.cache.get(path) if self.cache is not None else decode(path, self.min_size)
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
