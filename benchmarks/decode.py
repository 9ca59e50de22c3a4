"""The decode experiment: images/s of --device-augment's start-up decoding, each photo made a
square on the device, by nvJPEG in batches (gpu_decode) against the CPU's threads (what the
loader workers and the CPU path run: decode() and the antialiased resize), over the same files,
interleaved over the repetitions; and how far apart their pixels land."""
from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torchvision.transforms.v2.functional import resize

from benchmarks.instruments import Run, write_result
from my_dataset import decode, eval_resize
from speed.gpu_decode import decode_on_gpu
from utils import cpu_count, list_images


def squares_by_cpu(paths: list[str], side: int, device: torch.device, threads: int) -> torch.Tensor:
    def one(path: str) -> torch.Tensor:
        return resize(decode(path, side), [side, side], antialias=True)

    with ThreadPoolExecutor(max_workers=threads) as pool:
        return torch.stack(list(pool.map(one, paths))).to(device)


def squares_by_gpu(paths: list[str], side: int, device: torch.device, threads: int) -> torch.Tensor:
    pictures = decode_on_gpu(paths, device, threads)
    return torch.stack([resize(p if p is not None else decode(path, side).to(device), [side, side], antialias=True)
                        for path, p in zip(paths, pictures)])


def decode_rates(args: argparse.Namespace) -> dict:
    """The `decode` command."""
    run = Run("decode", args.machine)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    _, samples = list_images(args.data_path)
    paths = [p for p, _ in samples]
    for p in paths:
        Path(p).read_bytes()  # into the page cache first
    side, threads = eval_resize(args.img_size), args.threads or cpu_count()
    ways = {"cpu threads": squares_by_cpu, "nvjpeg batches": squares_by_gpu}
    times: dict[str, list[float]] = {name: [] for name in ways}
    squares = {}
    for repeat in range(args.repeats + 1):  # the first round warms up (nvJPEG's handles, CUDA's kernels)
        for name, way in (ways.items() if repeat % 2 == 0 else reversed(ways.items())):
            t0 = time.perf_counter()
            squares[name] = way(paths, side, device, threads)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if repeat:
                times[name].append(time.perf_counter() - t0)
    apart = (squares["cpu threads"].float() - squares["nvjpeg batches"].float()).abs().mean(dim=(1, 2, 3))
    rows = [{"way": name, "images_per_sec": round(len(paths) / statistics.median(secs), 1),
             "seconds": [round(s, 3) for s in secs]} for name, secs in times.items()]
    settings = {"data_path": args.data_path, "images": len(paths), "side": side, "threads": threads,
                "repeats": args.repeats, "device": str(device)}
    result = run.result(settings, ways=rows, grey_levels_apart={"mean": round(apart.mean().item(), 3),
                                                                "worst_image": round(apart.max().item(), 3)})
    table = ["| way | images/s |", "|---|---|"] + [f"| {r['way']} | {r['images_per_sec']:.0f} |" for r in rows]
    table.append(f"pixels apart: {apart.mean().item():.2f} grey levels on average, {apart.max().item():.2f} at worst")
    write_result(result, args.out, "\n".join(table))
    return result
