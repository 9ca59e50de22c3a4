"""Beyond one machine, on loopback: two torchrun "nodes" joined by c10d rendezvous, SLURM's
environment, and checkpoints that move between launchers and world sizes."""
from __future__ import annotations

import math
import os
import signal
import sys

import pytest
from conftest import FAST, SAMPLE, SMALL_MODEL, kill_group, launcher_cmd, metrics, start, start_job, wait_for_epochs, wait_until_gone

from multi_train_utils.rendezvous import find_free_port

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
pytestmark = pytest.mark.slow


def finish(procs, timeout: float = 240) -> list:
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=timeout)
            results.append((proc.returncode, out, err))
    finally:
        for proc in procs:
            kill_group(proc)
    for code, out, err in results:
        assert code == 0, f"exit {code}\n{out[-2000:]}\n{err[-3000:]}"
    return results


def test_two_nodes_joined_by_c10d_rendezvous(tmp_path):
    """Two torchrun agents, as on two machines, each with one process: one job of world size 2."""
    endpoint = f"127.0.0.1:{find_free_port()}"
    node = TORCHRUN + ["--nnodes=2", "--nproc_per_node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}",
                       "--rdzv-id=flowers-test", "train_multi_gpu_using_launch.py",
                       "--data-path", str(SAMPLE), "--output-dir", str(tmp_path), *FAST, *SMALL_MODEL, "--epochs", "1"]
    results = finish([start(node), start(node)])
    records = metrics(tmp_path)
    assert [r["world_size"] for r in records] == [2] and records[0]["val_total"] == 25
    assert sum(out.count("epoch 1/1: train loss") for _, out, _ in results) == 1  # rank 0 alone prints


def test_slurm_environment(tmp_path):
    """What `srun --ntasks=2` gives each task: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, plus
    the MASTER_ADDR/MASTER_PORT that the sbatch script exports."""
    port = str(find_free_port())
    procs = []
    for rank in (0, 1):
        env = {"SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank), "SLURM_NTASKS": "2", "SLURM_NNODES": "1",
               "SLURM_JOB_ID": "4242", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        cmd = [sys.executable, "train_multi_gpu_using_launch.py", "--data-path", str(SAMPLE),
               "--output-dir", str(tmp_path), *FAST, "--epochs", "1"]
        procs.append(start(cmd, env=env))
    finish(procs)
    assert [r["world_size"] for r in metrics(tmp_path)] == [2]


def test_slurm_without_master_address_is_a_clear_error():
    env = {"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "2"}
    proc = start([sys.executable, "train_multi_gpu_using_launch.py", "--data-path", str(SAMPLE)], env=env)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "MASTER_ADDR" in err and "Traceback" not in err, err


def stop_after(launcher: str, nproc: int, out, epochs: int, *extra: str) -> None:
    """Run until `epochs` epochs are logged, then Ctrl-C, as a user moving a job would."""
    proc, marker = start_job(launcher, out, "--epochs", "3", "--resume", "auto", *extra, nproc=nproc)
    wait_for_epochs(proc, out, epochs)
    os.killpg(proc.pid, signal.SIGINT)
    wait_until_gone(proc, marker)


def test_a_checkpoint_moves_between_launchers_and_world_sizes(tmp_path):
    """Epoch 1 on one process, epoch 2 under torchrun with 2, epoch 3 under spawn with 3:
    each continues from the previous checkpoint, and the learning rate follows the schedule
    of the run it is in (peak = lr x global batch / 256, warm-up 1 epoch, cosine to lrf)."""
    stop_after("single", 1, tmp_path, 1)
    stop_after("launch", 2, tmp_path, 2)
    cmd = launcher_cmd("spawn", 3) + ["--data-path", str(SAMPLE), "--output-dir", str(tmp_path), *FAST,
                                      *SMALL_MODEL, "--epochs", "3", "--resume", "auto"]
    proc = start(cmd)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-3000:]
    assert "2 epoch(s) done" in out
    records = metrics(tmp_path)
    assert [(r["epoch"], r["world_size"]) for r in records] == [(1, 1), (2, 2), (3, 3)]
    lr, lrf, batch = 0.1, 0.01, 8
    cosine = [1.0, lrf + (1 - lrf) * 0.5 * (1 + math.cos(math.pi * 0.5)), lrf]  # at the end of epochs 1, 2, 3
    for r, factor in zip(records, cosine):
        assert r["lr"] == pytest.approx(lr * batch * r["world_size"] / 256 * factor, rel=1e-6), r

