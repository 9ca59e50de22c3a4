"""--cache: every image decoded once into shared memory, one copy per machine, so the epochs
after the first skip JPEG decoding; and the room it needs."""
from __future__ import annotations

import mmap
import os
from multiprocessing import reduction
import secrets
import shutil
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from PIL import Image

from multi_train_utils.distributed_utils import DistContext, barrier, broadcast_object, raise_together
from my_dataset import cache_short_side
from utils import DataSplit, UserError, load_rgb


def shared_cache(split: DataSplit, config: Mapping[str, Any], ctx: DistContext) -> SharedImageCache:
    """Every image of the split in shared memory, at the size the run's transforms start from."""
    started = time.perf_counter()
    # all_gather, broadcast and 3 barriers: every process of a machine maps one file that they fill together
    cache = SharedImageCache.filled_together([p for p, _ in split.train + split.val], cache_short_side(config), ctx)
    ctx.print0(f"cache: {len(cache.shapes)} images, {cache.nbytes / 2**20:.0f} MiB of shared memory, one copy "
               f"for the {ctx.local_world_size} process(es) on this machine, filled in "
               f"{time.perf_counter() - started:.1f}s")
    return cache


class SharedImageCache:
    """Every image decoded once, resized to a short side of `short_side`, kept as uint8 RGB in
    one shared-memory file per machine.

    Local rank 0 creates the file in /dev/shm, every process on the machine maps it, and the
    name is removed before the (slow) decoding starts: the memory lives exactly as long as the
    processes mapping it, so a crash leaves nothing behind. Data-loader workers inherit the
    mapping when they fork, or map the file again through its descriptor when a fork server
    starts them (distributed_utils.loader_options), so there is one copy per machine, not one per
    rank or per worker.
    """

    def __init__(self, paths: Sequence[str], shapes: list[tuple[int, int]]):
        """The layout alone: where each picture of `paths`, of its (height, width), will lie."""
        self.index = {p: i for i, p in enumerate(paths)}
        self.shapes = shapes
        sizes = [h * w * 3 for h, w in self.shapes]
        self.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.nbytes = int(self.offsets[-1])

    @classmethod
    def filled_together(cls, paths: Sequence[str], short_side: int, ctx: DistContext) -> SharedImageCache:
        """The cache of `paths` at `short_side`, made by every process of the job at once: local
        rank 0 creates the file, all map it and fill their share of it. Collectives: an
        all_gather (whether each machine has the room), a broadcast of the file's name, and 3
        barriers."""
        if sys.platform != "linux":
            raise UserError("--cache needs Linux (a /dev/shm file shared with forked loader workers)")
        cache = cls(paths, [picture_shape(p, short_side) for p in paths])  # header reads only
        check_cache_room(cache.nbytes, ctx)
        token = broadcast_object(secrets.token_hex(8) if ctx.is_main else None, ctx)
        path = f"/dev/shm/imgcache-{token}-{machine_index(ctx)}"  # one per machine, even two "machines" on one
        creator = ctx.local_rank == 0
        if creator:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            os.ftruncate(fd, max(1, cache.nbytes))
        barrier(ctx)
        if not creator:
            fd = os.open(path, os.O_RDWR)
        cache._map = mmap.mmap(fd, max(1, cache.nbytes))
        cache._fd = fd  # kept open: a loader worker started by a fork server maps the memory through it
        barrier(ctx)
        if creator:
            os.unlink(path)
        cache.pixels = np.frombuffer(cache._map, dtype=np.uint8, count=cache.nbytes)
        mine = range(ctx.local_rank, len(paths), ctx.local_world_size)
        with ThreadPoolExecutor(max_workers=torch.get_num_threads()) as pool:  # PIL releases the GIL
            list(pool.map(lambda i: cache._fill(i, paths[i], short_side), mine))
        barrier(ctx)
        return cache

    def __getstate__(self) -> dict[str, Any]:
        """What a loader worker started by a fork server receives: the file, not the pixels."""
        state = {k: v for k, v in self.__dict__.items() if k not in ("_map", "pixels")}
        state["_fd"] = reduction.DupFd(self._fd)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._fd = state["_fd"].detach()
        self._map = mmap.mmap(self._fd, max(1, self.nbytes))
        self.pixels = np.frombuffer(self._map, dtype=np.uint8, count=self.nbytes)

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


def picture_shape(path: str, short_side: int) -> tuple[int, int]:
    """(height, width) of the upright picture, resized to a short side of `short_side`."""
    with Image.open(path) as img:
        w, h = img.size
        if img.getexif().get(0x0112) in (5, 6, 7, 8):  # EXIF says: rotated by 90 degrees
            w, h = h, w
    scale = short_side / min(w, h)
    return max(1, round(h * scale)), max(1, round(w * scale))


def check_cache_room(nbytes: int, ctx: DistContext) -> None:
    raise_together(cache_problem(nbytes, shutil.disk_usage("/dev/shm").free, memory_available()), ctx)


def cache_problem(nbytes: int, shm_free: int, available: int) -> str | None:
    """Why a cache of `nbytes` does not fit a machine with this much free /dev/shm and RAM, or None."""
    room = min(shm_free, available)
    if nbytes <= 0.8 * room:  # leave room for the model, the loaders and the rest of the machine
        return None
    return (f"--cache needs {nbytes / 2**30:.2f} GiB of shared memory, but only {room / 2**30:.2f} GiB is "
            "available (/dev/shm or free RAM): train without --cache, or with a smaller --img-size")


def memory_available() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))


def machine_index(ctx: DistContext) -> int:
    """Which machine of the job this process is on: torchrun's GROUP_RANK or SLURM's
    SLURM_NODEID; else the rank of the machine's local rank 0, as torchrun and srun's default
    block layout number them (`srun --distribution=cyclic` deals the ranks out to the
    machines in turn, and only SLURM_NODEID tells them apart)."""
    for name in ("GROUP_RANK", "SLURM_NODEID"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return ctx.rank - ctx.local_rank
