"""--cache: decoded pixels in shared memory, one copy per machine."""
from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import SAMPLE, kill_group, metrics, ok, processes_with_marker, start_job, train, wait_for_epochs

from multi_train_utils.distributed_utils import DistContext
from multi_train_utils.loaders import SharedImageCache, check_cache_room
from utils import UserError, list_images, load_rgb

SINGLE = DistContext.single()


def test_cached_pixels_are_the_resized_image():
    _, samples = list_images(str(SAMPLE))
    paths = [p for p, _ in samples[:6]]
    cache = SharedImageCache(paths, short_side=64, ctx=SINGLE)
    for path in paths:
        pixels = cache.get(path)
        assert pixels.dtype == torch.uint8 and min(pixels.shape[1:]) == 64
        h, w = pixels.shape[1:]
        expected = np.array(load_rgb(path, 64).resize((w, h), resample=2, reducing_gap=3.0))  # 2 = bilinear
        assert torch.equal(pixels.permute(1, 2, 0), torch.from_numpy(expected))
    assert not list(Path("/dev/shm").glob("imgcache-*")), "the shared-memory name must be gone once mapped"


def test_a_cache_that_would_not_fit_is_refused():
    with pytest.raises(UserError, match="--cache needs .* GiB of shared memory"):
        check_cache_room(10**15)  # a petabyte: more than any machine this runs on


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
    ok(train("single", tmp_path, "--epochs", "1", "--cache", "--img-size", "48"))
    record = metrics(tmp_path)[0]
    assert record["train_total"] == 95 and record["val_total"] == 25
