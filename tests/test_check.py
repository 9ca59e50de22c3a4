"""`--check` and the rendezvous that says who it waits for: real processes on loopback (gloo),
and the verdicts on machines this one is not, given as that machine's answers."""
from __future__ import annotations

import sys
import time

import pytest
from conftest import FAST, REPO, SAMPLE, run_cli

from multi_train_utils.distributed_utils import find_free_port


def as_srun_rank(rank: int, world_size: int, port: int) -> dict[str, str]:
    """The environment a hand-written job script or srun gives one process, without torchrun."""
    return {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}


@pytest.mark.slow
def test_a_run_waiting_for_a_rank_says_so_and_names_it(tmp_path):
    """Rank 0 of 2 with no rank 1: the run says what it waits for while it waits, then stops
    with the missing rank named (not silence until --dist-timeout)."""
    cmd = [sys.executable, "train_multi_gpu_using_launch.py", "--data-path", str(SAMPLE),
           "--output-dir", str(tmp_path), *FAST, "--dist-timeout", "7"]
    started = time.monotonic()
    result = run_cli(cmd, timeout=60, env=as_srun_rank(0, 2, find_free_port()))
    assert result.returncode == 1, result.stderr
    assert time.monotonic() - started < 30
    assert "waiting: 1 of 2 processes joined at 127.0.0.1:" in result.stdout
    assert "missing: rank 1" in result.stdout and "--check" in result.stdout
    assert result.stderr.strip().splitlines()[-1].startswith("error: 1 of 2 processes joined"), result.stderr
