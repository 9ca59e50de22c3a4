"""--device-augment: the training images decoded once into the device's memory, and each batch
cropped, resized and flipped there in one call; the loader workers only draw the crops."""
from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import torch
from torch.utils.data import DataLoader
from torchvision.transforms.v2.functional import resize

from multi_train_utils.distributed_utils import DistContext, all_reduce_sum, raise_together
from my_dataset import DeviceCrops, EpochKeys, PixelCache, SizeSchedule, decode
from speed import image_cache
from speed.gpu_decode import decode_on_gpu
from speed.image_cache import picture_shape
from utils import DataSplit


class DeviceAugmentedLoader:
    """The training loader of --device-augment: its workers draw each image's crop and flip
    (CropDraws), and each batch is cut from the pixels on the device, all images in one call
    (DeviceCrops), at the epoch's size. Iterated, sized and set to an epoch like a DataLoader;
    its batches are normalised float images already on the device."""

    def __init__(self, draws: DataLoader, crops: DeviceCrops, sizes: SizeSchedule):
        self.draws = draws
        self.crops = crops
        self.sizes = sizes
        self.sampler: EpochKeys = draws.sampler

    def __len__(self) -> int:
        return len(self.draws)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        size = (self.sampler.sizes or self.sizes)(self.sampler.epoch or 1)
        draws = iter(self.draws)  # now, not at the first batch: the workers start drawing at once
        return ((self.crops(batch, size), labels) for batch, labels in draws)


def device_crops(split: DataSplit, side: int, ctx: DistContext, cache: PixelCache | None) -> DeviceCrops:
    """The training images as DeviceCrops: each `side` px square, on this process's device.
    Each process decodes 1/world_size of them (and reads their frames), on the GPU where
    nvJPEG reads the file (gpu_decode), else on the CPU's threads; the others' places are left
    at zero, and a sum over the processes fills in the rest: every process ends with the same
    pixels, each decoded once."""
    started = time.perf_counter()
    paths = [p for p, _ in split.train]
    nbytes = len(paths) * 3 * side * side
    check_device_room(nbytes, ctx)
    pixels = torch.zeros(len(paths), 3, side, side, dtype=torch.uint8, device=ctx.device)
    frames = torch.zeros(len(paths), 2, dtype=torch.int64)
    mine = range(ctx.rank, len(paths), ctx.world_size)
    threads = torch.get_num_threads()
    on_gpu = [None] * len(mine)
    if ctx.device.type == "cuda" and cache is None:
        on_gpu = decode_on_gpu([paths[i] for i in mine], ctx.device, threads)

    def fill(i: int, picture: torch.Tensor | None) -> None:
        if picture is None:
            try:
                picture = cache.get(paths[i]) if cache is not None else decode(paths[i], side)
            except Exception as e:  # unreadable files were left out at start-up; this one changed since
                raise RuntimeError(f"cannot decode {paths[i]}: {e}") from e
        pixels[i] = resize(picture, [side, side], antialias=True)
        frames[i] = torch.tensor(picture_shape(paths[i], side))  # the frame --cache's pixels have

    with ThreadPoolExecutor(max_workers=threads) as pool:  # decoding releases the GIL
        list(pool.map(fill, mine, on_gpu))
    # One process filled each image's place, the others left it 0: the sums are the images.
    pixels = all_reduce_sum(pixels, ctx)
    frames = all_reduce_sum(frames.to(ctx.device), ctx)
    by_gpu = sum(p is not None for p in on_gpu)
    decoded = f", {by_gpu} of this process's {len(mine)} by nvJPEG" if ctx.device.type == "cuda" else ""
    ctx.print0(f"device augment: {len(paths)} training images, {nbytes / 2**20:.0f} MiB on {ctx.device} per "
               f"process, decoded in {time.perf_counter() - started:.1f}s{decoded}")
    return DeviceCrops(pixels, frames)


def check_device_room(nbytes: int, ctx: DistContext) -> None:
    free = torch.cuda.mem_get_info(ctx.device)[0] if ctx.device.type == "cuda" else image_cache.memory_available()
    problem = (
        f"--device-augment keeps the training images on {ctx.device}: {nbytes / 2**30:.2f} GiB, but only "
        f"{free / 2**30:.2f} GiB is free: train without it, or with a smaller --img-size"
    )
    # The rest is the model's, its activations' and the batch's.
    raise_together(problem if nbytes > 0.5 * free else None, ctx)
