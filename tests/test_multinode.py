"""Beyond one machine, on loopback: two torchrun "nodes" joined by c10d rendezvous, SLURM's
environment, and checkpoints that move between launchers and world sizes."""
from __future__ import annotations

import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import (FAST, FAST_DEFAULT_WORKERS, SAMPLE, SMALL_MODEL, STOP_WITHIN, child_pids, free_port, kill_group,
                      metrics, ok, processes_with_marker, start, start_job, train_here, wait_for_epochs, wait_until_gone)

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
pytestmark = pytest.mark.slow


def finish(procs, timeout: float = 240, marker: str | None = None) -> list:
    results, late = [], None
    try:
        for proc in procs:
            try:
                out, err = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                late = len(results)
                break
            results.append((proc.returncode, out, err))
    finally:
        for proc in procs:
            kill_group(proc)
        for pid in processes_with_marker(marker) if marker else ():  # torchrun's workers have sessions of their own
            os.kill(pid, signal.SIGKILL)
    if late is not None:  # what each agent had said, and its exit code once killed: where they wait
        for proc in procs[late:]:
            out, err = proc.communicate(timeout=30)
            results.append((proc.returncode, out, err))
        raise AssertionError(f"agent {late} still running after {timeout} s (then killed):" + "".join(
            f"\nagent {i}: exit {code}\n{out[-1500:]}\n{err[-4000:]}" for i, (code, out, err) in enumerate(results)))
    for code, out, err in results:
        assert code == 0, f"exit {code}\n{out[-2000:]}\n{err[-3000:]}"
    return results


def test_slurm_environment_tasks_in_pid_namespaces_of_their_own_with_their_own_copies(tmp_path):
    """What `srun --ntasks=2` gives each task: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, plus
    the MASTER_ADDR/MASTER_PORT that the sbatch script exports. Rank 1 runs in a PID namespace
    of its own, as containers that share a host name do (`docker run --network host`,
    Kubernetes' hostNetwork). Each resumes from its own copy of the run folder (a
    node-local copy), and rank 1's lacks split.json: rank 0's view decides what every rank does."""
    first, copy = tmp_path / "first", tmp_path / "copy"
    ok(train_here(first, "--epochs", "1", *SMALL_MODEL))
    shutil.copytree(first, copy)
    (copy / "split.json").unlink()
    own_namespace = ["unshare", "--pid", "--fork", "--mount-proc"]
    if os.geteuid() != 0 or shutil.which("unshare") is None or subprocess.run(
            [*own_namespace, "true"], capture_output=True).returncode != 0:
        own_namespace = []  # the rest still runs; the namespace needs root and util-linux's unshare
    port = str(free_port())
    procs = []
    for rank, folder in ((0, first), (1, copy)):
        env = {"SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank), "SLURM_NTASKS": "2", "SLURM_NNODES": "1",
               "SLURM_JOB_ID": "4242", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        cmd = [sys.executable, "train_multi_gpu_using_launch.py", "--data-path", str(SAMPLE), "--output-dir",
               str(folder), *FAST, *SMALL_MODEL, "--epochs", "3", "--resume", str(folder / "last.pth")]
        procs.append(start((own_namespace if rank == 1 else []) + cmd, env=env))
    results = finish(procs)
    assert [r["world_size"] for r in metrics(first)] == [1, 2, 2]
    assert "ended" not in results[0][2] + results[1][2]
    if not own_namespace:
        pytest.skip("ran without a PID namespace of its own for rank 1: unshare needs root here")


def test_slurm_without_master_address_is_a_clear_error():
    env = {"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "2"}
    proc = start([sys.executable, "train_multi_gpu_using_launch.py", "--data-path", str(SAMPLE)], env=env)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "MASTER_ADDR" in err and "Traceback" not in err, err


def test_a_checkpoint_moves_between_launchers_and_world_sizes_each_stopped_by_ctrl_c(tmp_path):
    """Epoch 1 on one process, epoch 2 under torchrun with 2, epoch 3 under spawn with 3, each
    job stopped by Ctrl-C as a user moving it would (SIGINT to the whole job, loader workers
    included): every process of the job ends within STOP_WITHIN seconds, each training process
    reports it (the spawn launcher may end its processes first, and reports once for the job),
    and the exit code is 130, the shell's for SIGINT (torchrun replaces it with its own 1). Each
    job continues from the previous checkpoint, and the learning rate follows the schedule of
    the run it is in (peak = lr x global batch / 256, warm-up 1 epoch, cosine to lrf)."""
    for launcher, nproc, epochs in (("single", 1, 1), ("launch", 2, 2), ("spawn", 3, 3)):
        proc, marker = start_job(launcher, tmp_path, "--epochs", "4", "--resume", "auto", "--workers", "1",
                                 nproc=nproc)
        wait_for_epochs(proc, tmp_path, epochs)
        saved(tmp_path)  # in training, not in rank 0's write of the epoch's checkpoint (the next test's)
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal does on Ctrl-C
        seconds, err = wait_until_gone(proc, marker)
        assert seconds < STOP_WITHIN, (seconds, err[-2000:])
        assert err.splitlines().count("interrupted") >= (1 if launcher == "spawn" else nproc), err[-3000:]
        # torchrun's agent, interrupted too, ends 1; once, in a .ci/run on 2 busy cores, it aborted
        # instead in its own interpreter's shutdown (-6, its KeyboardInterrupt's traceback, then
        # CPython's fatal-error dump): torch's and CPython's, after every process of ours had ended.
        agent_aborted = launcher == "launch" and proc.returncode == -signal.SIGABRT and "Fatal Python error" in err
        assert proc.returncode == (1 if launcher == "launch" else 130) or agent_aborted, (proc.returncode, err[-4000:])
    records = metrics(tmp_path)
    assert [(r["epoch"], r["world_size"]) for r in records] == [(1, 1), (2, 2), (3, 3)]
    lr, lrf, batch = 0.1, 0.01, 8
    cosine = [1.0] + [lrf + (1 - lrf) * 0.5 * (1 + math.cos(math.pi * done / 3)) for done in (1, 2)]  # epochs 1-3 of 4
    for r, factor in zip(records, cosine):
        assert r["lr"] == pytest.approx(lr * batch * r["world_size"] / 256 * factor, rel=1e-6), r


def saved(out: Path, timeout: float = 120) -> None:
    """Wait until rank 0 has written the checkpoint of the epoch metrics.jsonl names last (the
    line goes first): last.pth renamed into place after it, no temporary file left."""
    deadline = time.monotonic() + timeout
    while list(out.glob(".*.pth.tmp")) or (out / "last.pth").stat().st_mtime < (out / "metrics.jsonl").stat().st_mtime:
        assert time.monotonic() < deadline, sorted(p.name for p in out.iterdir())
        time.sleep(0.01)


def test_ctrl_c_while_rank_0_writes_a_checkpoint_is_an_interruption(tmp_path):
    """Ctrl-C (SIGINT to the job) while the one process writes its epoch's checkpoint, inline, in
    the middle of the file: the run ends as any Ctrl-C ends it, "interrupted" and 130, within
    STOP_WITHIN seconds; the cut-off write leaves its temporary file, never a torn last.pth."""
    proc, marker = start_job("single", tmp_path, "--epochs", "4", "--workers", "1", nproc=1)
    deadline = time.monotonic() + 180
    while not [p for p in tmp_path.glob(".*.pth.tmp") if p.exists() and p.stat().st_size > 4 << 20]:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()  # epoch 1's best.pth, 90 MB
        time.sleep(0.0005)
    os.killpg(proc.pid, signal.SIGINT)
    seconds, err = wait_until_gone(proc, marker)
    assert seconds < STOP_WITHIN, (seconds, err[-2000:])
    assert not (tmp_path / "last.pth").exists() and list(tmp_path.glob(".*.pth.tmp"))
    assert proc.returncode == 130 and err.splitlines()[-1] == "interrupted", (proc.returncode, err[-3000:])


def agent(out, run_id: str, endpoint: str, nnodes: str, *extra: str, fast: list[str] = FAST) -> list[str]:
    """One torchrun agent, as on a machine of its own, with one worker: an elastic job that
    goes on from last.pth after a restart."""
    return TORCHRUN + [f"--nnodes={nnodes}", "--nproc_per_node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}",
                       f"--rdzv-id={run_id}", "--rdzv-conf=last_call_timeout=1", "--max-restarts=1",
                       "--monitor-interval=0.5",
                       "train_multi_gpu_using_launch.py", "--data-path", str(SAMPLE), "--output-dir", str(out), *fast,
                       *SMALL_MODEL, "--resume", "auto", *extra]


# Two "machines" on one machine: a process each.
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def test_two_agents_restart_after_a_worker_on_one_of_them_dies(tmp_path):
    """Two torchrun agents on loopback (two "nodes", c10d rendezvous, --max-restarts=1) make one
    job of world size 2, whose rank 0 alone prints; the worker under the second agent is killed
    after epoch 1. Both agents restart their workers, which meet as a new attempt at the agent's
    store, under a prefix of their attempt (cluster/rendezvous.job_store: the failed group's keys
    are still there, pytorch#135712), go on from last.pth, finish, and log each epoch once; no
    rank names a false cause."""
    endpoint = f"127.0.0.1:{free_port()}"
    marker = f"two-agents-{os.getpid()}-{tmp_path.name}"
    env = {**ONE_THREAD, "TEST_JOB_MARKER": marker}
    first = start(agent(tmp_path, marker, endpoint, "2", "--epochs", "3"), env=env)
    second = start(agent(tmp_path, marker, endpoint, "2", "--epochs", "3"), env=env)
    wait_for_epochs(first, tmp_path, 1)
    worker = child_pids(second.pid)
    assert len(worker) == 1, worker
    os.kill(worker[0], signal.SIGKILL)
    results = finish([first, second], marker=marker)
    records = metrics(tmp_path)
    assert [(r["epoch"], r["world_size"]) for r in records] == [(1, 2), (2, 2), (3, 2)]
    assert records[0]["val_total"] == 25
    assert sum(out.count("epoch 3/3: train loss") for _, out, _ in results) == 1  # rank 0 alone prints
    assert sum(out.count("resumed from") for _, out, _ in results) == 1  # rank 0 of the new attempt
    for _, out, err in results:
        assert "disagree" not in err and "claim rank" not in err, err[-3000:]


def test_a_second_agent_joining_restarts_the_job_with_both(tmp_path):
    """torchrun --nnodes=1:2: the job starts on one agent, and a second joins after epoch 1.
    The first agent stops its worker (SIGTERM to the worker alone: it saves where it is, its
    default loader workers running), both restart as a job of two without raising torchrun's
    restart count, and the run goes on from last.pth at the new world size and finishes, each
    epoch logged once. (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: without it, torch's agents wait on
    each other after a node joins; docs/multi-node.md.)"""
    endpoint = f"127.0.0.1:{free_port()}"
    marker = "joining-" + tmp_path.name
    env = {**ONE_THREAD, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "TEST_JOB_MARKER": marker}
    first = start(agent(tmp_path, marker, endpoint, "1:2", "--epochs", "4", fast=FAST_DEFAULT_WORKERS), env=env)
    wait_for_epochs(first, tmp_path, 1)
    second = start(agent(tmp_path, marker, endpoint, "1:2", "--epochs", "4", fast=FAST_DEFAULT_WORKERS), env=env)
    results = finish([first, second], marker=marker)
    records = metrics(tmp_path)
    assert [r["epoch"] for r in records] == [1, 2, 3, 4]
    assert records[0]["world_size"] == 1 and records[-1]["world_size"] == 2
    for _, out, err in results:
        assert "disagree" not in err and "claim rank" not in err, err[-3000:]
