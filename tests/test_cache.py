"""--cache: decoded pixels in shared memory, one copy per machine."""
from __future__ import annotations

import datetime
import os
import socket
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import SAMPLE, kill_group, metrics, ok, processes_with_marker, start_job, train_here, wait_for_epochs

from multi_train_utils.distributed_utils import DistContext, Ranks, process_context
from speed import image_cache
from speed.device_augment import check_device_room
from speed.image_cache import SharedImageCache, check_cache_room
from utils import UserError, list_images, load_rgb

SINGLE = DistContext.single()


def test_cached_pixels_are_the_resized_image():
    _, samples = list_images(str(SAMPLE))
    paths = [p for p, _ in samples[:6]]
    cache = SharedImageCache.filled_together(paths, short_side=64, ctx=SINGLE)
    for path in paths:
        pixels = cache.get(path)
        assert pixels.dtype == torch.uint8 and min(pixels.shape[1:]) == 64
        h, w = pixels.shape[1:]
        expected = np.array(load_rgb(path, 64).resize((w, h), resample=2, reducing_gap=3.0))  # 2 = bilinear
        assert torch.equal(pixels.permute(1, 2, 0), torch.from_numpy(expected))
    assert not list(Path("/dev/shm").glob("imgcache-*")), "the shared-memory name must be gone once mapped"


def test_a_cache_that_would_not_fit_is_refused():
    with pytest.raises(UserError, match="--cache needs .* GiB of shared memory"):
        check_cache_room(10**15, SINGLE)  # a petabyte: more than any machine this runs on


def find_free_port() -> int:
    """A port nothing listens on now, on loopback."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _short_of_memory_on_rank_1(rank: int, port: int, out: str, check: str) -> None:
    """One rank of two, rank 1 on a "machine" with 1 KiB free; writes how the check ended. The
    process group is made as the spawn launcher makes it."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    ctx = process_context(Ranks(rank, rank, 2, 2), "cpu", "gloo")
    dist.init_process_group(ctx.backend, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    if rank == 1:
        image_cache.memory_available = lambda: 1024
    try:
        if check == "cache":
            SharedImageCache.filled_together([p for p, _ in list_images(str(SAMPLE))[1][:6]], short_side=32, ctx=ctx)
        else:
            check_device_room(2**20, ctx)
        outcome = "went on"
    except UserError as e:
        outcome = str(e)
    finally:
        dist.destroy_process_group()
    Path(out, str(rank)).write_text(outcome)


@pytest.mark.slow
@pytest.mark.parametrize("check", ["cache", "device-augment"])
def test_one_machine_short_of_memory_stops_every_rank_with_the_same_error(tmp_path, check):
    """The ranks decide together: both leave at once with the error of the rank that lacks
    room, instead of one leaving and the other waiting in a collective until the timeout."""
    started = time.monotonic()
    mp.spawn(_short_of_memory_on_rank_1, args=(find_free_port(), str(tmp_path), check), nprocs=2)
    assert time.monotonic() - started < 60  # sooner than the group's timeout (60 s), whatever the machine's speed
    outcomes = [(tmp_path / str(rank)).read_text() for rank in (0, 1)]
    assert outcomes[0] == outcomes[1], outcomes
    assert outcomes[0].startswith("rank 1 on ") and f"--{check} " in outcomes[0] and "\n" not in outcomes[0]


def _cache_mappings(pid: int) -> set[int]:
    """Inodes of the /dev/shm cache files that process `pid` has mapped."""
    try:
        lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    except OSError:
        return set()
    return {int(line.split()[4]) for line in lines if "/dev/shm/imgcache-" in line}


@pytest.mark.slow
def test_one_copy_per_machine_whatever_the_world_size(tmp_path):
    """Two ranks and their loader workers all map the same (deleted) shared-memory file:
    the decoded pixels exist once on the machine."""
    proc, marker = start_job("spawn", tmp_path, "--epochs", "30", "--workers", "1", "--cache", "--img-size", "48")
    try:
        wait_for_epochs(proc, tmp_path, 1)
        pids = processes_with_marker(marker)
        inodes = {pid: _cache_mappings(pid) for pid in pids}
        mapping = {pid: ino for pid, ino in inodes.items() if ino}
        # launcher + 2 ranks + 2 loader workers (+ resource tracker): ranks and workers map the cache
        assert len(mapping) >= 4, inodes
        assert len(set().union(*mapping.values())) == 1, mapping
    finally:
        kill_group(proc)
        deadline = time.monotonic() + 20
        while processes_with_marker(marker) and time.monotonic() < deadline:
            time.sleep(0.1)
        for pid in processes_with_marker(marker):
            os.kill(pid, 9)
    assert not list(Path("/dev/shm").glob("imgcache-*"))


@pytest.mark.slow
def test_training_with_cache_counts_every_image_once(tmp_path):
    ok(train_here(tmp_path, "--epochs", "1", "--cache", "--img-size", "48"))
    record = metrics(tmp_path)[0]
    assert record["train_total"] == 95 and record["val_total"] == 25
    assert record["train_seen"] == 88  # 11 batches of 8: the last 7 images of the shuffle are dropped
