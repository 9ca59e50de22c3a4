"""What real clusters do that a laptop does not, at the one place the code meets each: --check's
threads on a node of several GPUs, one GPU per task (`srun --gpus-per-task=1`), the store srun's
tasks meet at (its timeout, the ranks it names), the user's umask, SLURM's cyclic task layout,
srun's CPU binding, and a SIGTERM to every process of the job, loader workers and the fork server
they start from included. The real processes and schedulers are tests/test_slurm.py's,
tests/test_multinode.py's and tests/test_preemption.py's."""
from __future__ import annotations

import datetime
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO, free_port

from cluster import check
from cluster.rendezvous import job_store
from multi_train_utils.checkpoint import save_atomic
from multi_train_utils.config import get_args_parser
from multi_train_utils.distributed_utils import DistContext, Ranks, loader_options, resolve_device
from speed.image_cache import machine_index
from utils import ProjectError, UserError


def test_a_check_stage_runs_on_the_ranks_gpu(monkeypatch):
    """A new thread's current GPU is cuda:0: each stage's thread takes the rank's first."""
    chosen = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: chosen.append((threading.current_thread().name,
                                                                                  device)))
    assert check.bounded("the inventory", 5, lambda: threading.current_thread().name,
                         torch.device("cuda", 3)) == "check the inventory"
    assert chosen == [("check the inventory", torch.device("cuda", 3))]
    check.bounded("the figures", 5, lambda: None, torch.device("cpu"))
    assert len(chosen) == 1


def test_a_task_that_sees_one_gpu_takes_it_whatever_its_local_rank(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # srun --gpus-per-task=1
    assert resolve_device("cuda", 3, 4, distributed=True) == torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("cuda", 1, 2, distributed=True) == torch.device("cuda", 1)
    with pytest.raises(UserError, match="start at most 2 process"):
        resolve_device("cuda", 2, 4, distributed=True)


def test_the_store_waits_as_long_as_dist_timeout(monkeypatch):
    """init_process_group sets its timeout only on a store it makes itself; the store srun's
    tasks meet at must wait --dist-timeout (NCCL's start waits on it), not a fixed minute."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    store = job_store(Ranks(0, 0, 1, 1, srun_task=True), 123)
    assert store.timeout == datetime.timedelta(seconds=123)


def test_the_store_names_the_missing_ranks_and_rank_0_missing(monkeypatch):
    """Rank 0 waits --dist-timeout for the others, then names the missing (not torch's silence);
    a rank whose rank 0 is missing says where it looked, after as long."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    started = time.monotonic()
    with pytest.raises(ProjectError, match=r"^1 of 3 processes joined at 127.0.0.1:\d+ within 2 s \(--dist-timeout\); "
                                           r"missing: rank 1, rank 2$"):
        job_store(Ranks(0, 0, 3, 3, srun_task=True), 2)
    assert 2 <= time.monotonic() - started < 10
    with pytest.raises(ProjectError, match=r"^rank 1 on \S+: no rendezvous at 127.0.0.1:\d+ within 2 s"):
        job_store(Ranks(1, 1, 3, 3, srun_task=True), 2)


def test_ranks_started_for_different_counts_stop_together_with_one_line(monkeypatch):
    """Rank 1 started for 3 processes, rank 0 for 2 (a job script's mistake): rank 0 says so at
    once, and rank 1 learns rank 0's verdict, instead of both waiting for a rank that never comes."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    outcomes = {}

    def join(rank: int, world_size: int) -> None:
        try:
            job_store(Ranks(rank, rank, world_size, world_size, srun_task=True), 20)
            outcomes[rank] = "joined"
        except ProjectError as e:
            outcomes[rank] = str(e)

    started = time.monotonic()
    threads = [threading.Thread(target=join, args=(0, 2)), threading.Thread(target=join, args=(1, 3))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert time.monotonic() - started < 15  # not --dist-timeout's 20 s
    wrong = "rank 1 was started for 3 processes (WORLD_SIZE, SLURM_NTASKS), rank 0 for 2"
    assert outcomes[0].startswith(wrong), outcomes
    assert outcomes[1].startswith(f"rank 0 ended the rendezvous: {wrong}"), outcomes


@pytest.mark.slow
def test_a_process_bound_to_its_own_cores_by_srun_keeps_them_all():
    """srun --cpus-per-task=N binds each task to its own N CPUs (SLURM_CPUS_PER_TASK): that is its
    share already, not a set to divide again by the tasks per node; a process torchrun started
    shares what it may run on with the others of its machine (taskset stands in for srun's
    binding). Its loader workers: those CPUs less one, at least one."""
    code = ("import torch; from multi_train_utils.distributed_utils import Ranks, cpus_per_process; "
            "from my_dataset import default_workers; "
            "srun, torchrun = cpus_per_process(Ranks(0, 0, 4, 4, srun_task=True)), cpus_per_process(Ranks(0, 0, 4, 4)); "
            "print(srun, torchrun, default_workers(torch.device('cuda'), srun))")
    if (os.cpu_count() or 1) < 2:
        pytest.skip("needs 2 CPUs: one to bind to, one left out")
    env = {**os.environ, "SLURM_CPUS_PER_TASK": "2"}
    bound = subprocess.run(["taskset", "-c", "0", sys.executable, "-c", code], cwd=REPO, capture_output=True,
                           text=True, check=True, env=env).stdout.split()
    assert bound == ["1", "1", "1"]  # one CPU, whatever SLURM_CPUS_PER_TASK says: one thread, one loader worker
    whole = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True,
                           env=env).stdout.split()
    cores = len(os.sched_getaffinity(0))
    assert whole == [str(min(2, cores)), str(max(1, cores // 4)), str(max(1, min(2, cores) - 1))]


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o002, 0o664), (0o077, 0o600)])
def test_a_checkpoint_takes_the_users_umask(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        save_atomic({"epoch": 1}, tmp_path / "last.pth")
    finally:
        os.umask(old)
    assert (tmp_path / "last.pth").stat().st_mode & 0o777 == mode


def test_the_image_cache_is_one_per_machine_under_any_task_layout(monkeypatch):
    ctx = DistContext(rank=5, local_rank=2, world_size=8, local_world_size=4, device=torch.device("cpu"),
                      distributed=True)
    for name in ("GROUP_RANK", "SLURM_NODEID"):
        monkeypatch.delenv(name, raising=False)
    assert machine_index(ctx) == 3  # torchrun's and srun's block layout: ranks 3 to 6 share a machine
    monkeypatch.setenv("SLURM_NODEID", "1")  # srun --distribution=cyclic: rank 5 is on node 1
    assert machine_index(ctx) == 1
    monkeypatch.setenv("GROUP_RANK", "0")
    assert machine_index(ctx) == 0


def alive(pid: int) -> bool:
    """Running, not a zombie waiting for its parent to note its end."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX"
    except OSError:
        return False


class Slow(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 10**6

    def __getitem__(self, index: int) -> torch.Tensor:
        time.sleep(0.01)
        return torch.zeros(3)


@pytest.mark.slow
@pytest.mark.parametrize("distributed", [False, True])  # forked by the training process; by a fork server
def test_a_loader_worker_and_its_fork_server_outlive_a_sigterm_from_outside_and_end_with_the_trainer(distributed):
    """slurmstepd and `kill -TERM -PGID` signal the workers too, and on this CPython the fork
    server they start from in a job (loader_options): they must go on serving the training
    process, which stops at a step and saves. Its own end (the DataLoader's shutdown, as the
    process exits) still ends the workers."""
    ctx = DistContext(0, 0, 2, 2, torch.device("cpu"), distributed=True) if distributed else DistContext.single()
    args = get_args_parser("test").parse_args(["--workers", "1", "--batch-size", "2"])
    options = loader_options(args, ctx)
    affected = sys.version_info < (3, 11, 10) or (3, 12) <= sys.version_info < (3, 12, 1)
    assert (options["multiprocessing_context"] is not None) == (distributed and affected)
    loader = torch.utils.data.DataLoader(Slow(), **options)
    batches = iter(loader)
    next(batches)
    worker = batches._workers[0]
    parent = int(Path(f"/proc/{worker.pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    server = parent if parent != os.getpid() else None  # the worker's parent: the fork server, or this process
    assert (server is not None) == (distributed and affected)
    for pid in [worker.pid] + ([server] if server else []):
        subprocess.run(["kill", "-TERM", str(pid)], check=True)  # from another process
    time.sleep(1)
    for _ in range(5):
        next(batches)
    assert worker.is_alive() and (server is None or alive(server))
    batches._shutdown_workers()  # what the DataLoader does as the training process ends
    assert not worker.is_alive()
