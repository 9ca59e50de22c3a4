"""JPEG decoding on the GPU, in batches (nvJPEG, through torchvision.io.decode_jpeg(...,
device="cuda")), for --device-augment on a GPU: its start-up decoding of the training images,
and the validation images, decoded once and kept on the GPU in place of a validation loader.

Only what nvJPEG reads as the CPU does goes there: baseline JPEGs in colour that EXIF does not
rotate. Everything else (PNG and other formats, greyscale and CMYK JPEGs, progressive JPEGs,
pictures EXIF turns upright) and any file nvJPEG refuses is decoded by the CPU, as before: the
same images and labels either way, the pixels within a grey level or two (two JPEG decoders)."""
from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch
from PIL import Image
from torchvision.io import ImageReadMode, decode_jpeg, read_file

from multi_train_utils.distributed_utils import DistContext
from my_dataset import MyDataSet



def nvjpeg_reads(path: str) -> bool:
    """Whether nvJPEG decodes this file to the picture the CPU gives: a baseline colour JPEG
    that EXIF does not rotate (reads the header only)."""
    try:
        with Image.open(path) as img:
            return (img.format == "JPEG" and img.mode == "RGB" and not img.info.get("progressive")
                    and img.getexif().get(0x0112, 1) == 1)  # EXIF's orientation tag: 1, upright
    except OSError:
        return False


def decode_on_gpu(paths: Sequence[str], device: torch.device, threads: int, batch: int = 128) -> list[torch.Tensor | None]:
    """Each file decoded on `device` as a uint8 CHW picture, or None where the CPU must decode it;
    `batch` files per batched decode: a few hundred MB of full-size pictures at most."""
    with ThreadPoolExecutor(max_workers=threads) as pool:  # header and file reads release the GIL
        readable = list(pool.map(nvjpeg_reads, paths))
        pictures: list[torch.Tensor | None] = [None] * len(paths)
        chosen = [i for i, ok in enumerate(readable) if ok]
        for start in range(0, len(chosen), batch):
            chunk = chosen[start:start + batch]
            data = list(pool.map(read_file, [paths[i] for i in chunk]))
            for i, picture in zip(chunk, _decode_batch(data, device)):
                pictures[i] = picture
    return pictures


def _decode_batch(data: list[torch.Tensor], device: torch.device) -> list[torch.Tensor | None]:
    try:
        return decode_jpeg(data, mode=ImageReadMode.RGB, device=device)
    except RuntimeError:  # one file nvJPEG refuses fails the batch: then each alone
        return [_decode_one(d, device) for d in data]


def _decode_one(data: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    try:
        return decode_jpeg(data, mode=ImageReadMode.RGB, device=device)
    except RuntimeError:
        return None


class DeviceBatches:
    """A rank's validation images, transformed and kept on the device, served in the order and
    batches a DataLoader over `sampler` gives (the predictions map them back through it)."""

    def __init__(self, pixels: torch.Tensor, labels: torch.Tensor, sampler: Sequence[int], batch_size: int):
        self.pixels, self.labels = pixels, labels
        self.sampler = sampler
        self.batch_size = batch_size

    def __len__(self) -> int:
        return math.ceil(len(self.pixels) / self.batch_size)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for start in range(0, len(self.pixels), self.batch_size):
            yield self.pixels[start:start + self.batch_size], self.labels[start:start + self.batch_size]


def validation_on_device(val_set: MyDataSet, sampler: Sequence[int], batch_size: int, ctx: DistContext,
                         threads: int) -> DeviceBatches:
    """This rank's shard of `val_set` (the indices `sampler` gives), decoded once, on the GPU
    where nvJPEG reads the file, put through the dataset's own evaluation transform there, and
    kept on the device: every epoch's evaluation then reads no file."""
    indices = list(sampler)
    pictures = decode_on_gpu([val_set.samples[i][0] for i in indices], ctx.device, threads)
    images = [val_set.transform(p) if p is not None else val_set[i][0].to(ctx.device)
              for i, p in zip(indices, pictures)]
    labels = torch.tensor([val_set.samples[i][1] for i in indices], device=ctx.device)
    pixels = torch.stack(images) if images else torch.zeros(0, 3, 1, 1, dtype=torch.uint8, device=ctx.device)
    return DeviceBatches(pixels, labels, indices, batch_size)
