"""The data experiment: images/s of each way to decode a JPEG and apply the training transform,
in one process with one thread, as a data-loader worker runs it."""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from torchvision.io import ImageReadMode, decode_jpeg, read_file
from torchvision.transforms import v2

from benchmarks.instruments import Run, write_result
from benchmarks.seed_recipe import seed_transforms
from my_dataset import build_transform, decode, normalize
from utils import list_images, load_rgb

TRANSFORM = ("RandomResizedCrop + RandomHorizontalFlip, giving uint8 pixels; rows marked 'float, normalise' also "
             "convert and normalise in the worker, as the seed does (ours does it on the device, per batch)")


def _pil(path: str) -> Image.Image:
    with Image.open(path) as img:
        return img.convert("RGB")


def _tensor_jpeg(path: str) -> torch.Tensor:
    return decode_jpeg(read_file(path), mode=ImageReadMode.RGB, apply_exif_orientation=True)


def _in_worker(pixels: torch.Tensor) -> torch.Tensor:
    """What ours' workers did before normalising moved to the device: worth a row of its own."""
    return normalize(pixels.unsqueeze(0))[0]


def pipelines(size: int) -> dict[str, Callable[[str], Any]]:
    """Each path, by name: decoding alone ("decode: ..."), then decoding and the training transform."""
    v2_train = build_transform(size, train=True)  # the project's: PIL to uint8 tensor first, then the geometry
    on_pil = v2.Compose([*v2_train.transforms[1:], v2.PILToTensor()])  # the same geometry, on the PIL image
    v1_train = seed_transforms(size)[0]
    return {
        "decode: PIL": _pil,
        "decode: PIL draft (load_rgb)": lambda p: load_rgb(p, size),
        "decode: torchvision.io.decode_jpeg": _tensor_jpeg,
        "seed: PIL + v1 on PIL + float, normalise": lambda p: v1_train(_pil(p)),
        "PIL + v2 on PIL": lambda p: on_pil(_pil(p)),
        "PIL + v2 on uint8 tensor": lambda p: v2_train(_pil(p)),
        "PIL draft + v2 on PIL": lambda p: on_pil(load_rgb(p, size)),
        "PIL draft + v2 on uint8 tensor": lambda p: v2_train(load_rgb(p, size)),
        "decode_jpeg + v2 on uint8 tensor": lambda p: v2_train(_tensor_jpeg(p)),
        "decode_jpeg + v2 on uint8 tensor + float, normalise": lambda p: _in_worker(v2_train(_tensor_jpeg(p))),
        "decode() + v2 on uint8 tensor (ours)": lambda p: v2_train(decode(p, size)),
    }


def data_paths(args: argparse.Namespace) -> dict[str, Any]:
    """The `data` command: every path over the same images, interleaved over the repetitions."""
    run = Run("data", args.machine)
    torch.set_num_threads(1)
    _, samples = list_images(args.data_path)
    step = max(1, len(samples) // args.images) if args.images else 1
    paths = [p for p, _ in samples][::step][: args.images or None]
    for p in paths:
        Path(p).read_bytes()  # into the page cache, so the first path timed does not pay for the disk
    size = args.img_size
    by_name = pipelines(size)
    times: dict[str, list[float]] = {name: [] for name in by_name}
    for repeat in range(args.repeats):
        for name, fn in (by_name.items() if repeat % 2 == 0 else reversed(by_name.items())):
            torch.manual_seed(0)  # the same crops for every path
            t0 = time.perf_counter()
            for p in paths:
                fn(p)
            times[name].append(time.perf_counter() - t0)
    rows = []
    for name, secs in times.items():
        rate = len(paths) / statistics.median(secs)
        rows.append({"path": name, "images_per_sec": round(rate, 1), "ms_per_image": round(1000 / rate, 2),
                     "images_per_sec_all": [round(len(paths) / s, 1) for s in secs]})
    full = [r for r in rows if not r["path"].startswith("decode:")]
    fastest = max(full, key=lambda r: r["images_per_sec"])
    ours = next(r for r in rows if r["path"].endswith("(ours)"))
    settings = {"data_path": args.data_path, "images": len(paths), "img_size": size, "repeats": args.repeats,
                "threads": 1, "transform": TRANSFORM}
    result = run.result(settings, paths=rows, fastest=fastest["path"],
                        fastest_vs_ours=round(fastest["images_per_sec"] / ours["images_per_sec"], 3))
    table = ["| path | images/s | ms/image |", "|---|---|---|"]
    table += [f"| {r['path']} | {r['images_per_sec']:.1f} | {r['ms_per_image']:.2f} |" for r in rows]
    table.append(f"fastest decode + transform: {fastest['path']} ({fastest['images_per_sec']:.1f} img/s, "
                 f"{result['fastest_vs_ours']:.2f}x ours)")
    write_result(result, args.out, "\n".join(table))
    return result
