"""What real clusters do that a laptop does not, at the one place the code meets each: --check's
threads on a node of several GPUs, one GPU per task (`srun --gpus-per-task=1`), the store's
timeout on every rank, the user's umask, SLURM's cyclic task layout, srun's CPU binding, and a
SIGTERM to every process of the job. The real processes and schedulers are
tests/test_slurm.py's, tests/test_multinode.py's and tests/test_preemption.py's."""
from __future__ import annotations

import datetime
import functools
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from conftest import REPO

from cluster import check
from multi_train_utils.checkpoint import save_atomic
from multi_train_utils.distributed_utils import (DistContext, Ranks, find_free_port, job_store,
                                                 prepare_helper_start, resolve_device)
from multi_train_utils.loaders import start_worker
from speed.image_cache import machine_index
from utils import UserError


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
    """init_process_group sets its timeout only on a store it makes itself; the store the job
    meets at must wait --dist-timeout (NCCL's start waits on it), not the minute of the join."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(find_free_port()))
    store = job_store(Ranks(0, 0, 1, 1), 123)
    assert store.timeout == datetime.timedelta(seconds=123)


@pytest.mark.slow
def test_a_process_bound_to_its_own_cores_by_srun_keeps_them_all():
    """srun --cpus-per-task=8 binds each task to its own 8 CPUs: that is its share already, not
    a set to divide again by the tasks per node (taskset stands in for srun's binding)."""
    code = ("import torch; from utils import cores_per_process; "
            "from my_dataset import default_workers; "
            "print(cores_per_process(4), default_workers(torch.device('cuda'), 4))")
    if (os.cpu_count() or 1) < 2:
        pytest.skip("needs 2 CPUs: one to bind to, one left out")
    bound = subprocess.run(["taskset", "-c", "0", sys.executable, "-c", code], cwd=REPO, capture_output=True,
                           text=True, check=True).stdout.split()
    assert bound == ["1", "1"]  # one CPU: one thread, and one loader worker (at least one)
    whole = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                           check=True).stdout.split()
    cores = len(os.sched_getaffinity(0))
    assert whole == [str(max(1, cores // 4)), str(max(1, cores // 4 - 1))]


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


class Slow(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 10**6

    def __getitem__(self, index: int) -> torch.Tensor:
        time.sleep(0.01)
        return torch.zeros(3)


FORK_SERVER_SIGTERM = """
import os, signal, multiprocessing.forkserver, torch, torch.distributed as dist
from multi_train_utils.distributed_utils import DistContext, find_free_port, prepare_helper_start
came = []
signal.signal(signal.SIGTERM, lambda signum, frame: came.append(signum))  # as a launcher's handler
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(find_free_port()))
dist.init_process_group("gloo", rank=0, world_size=1)  # gloo's threads: any thread may take a signal
start = multiprocessing.forkserver.ensure_running
def start_then_sigterm():  # SLURM's warning to every process of the job, the server just started
    start()
    os.killpg(0, signal.SIGTERM)
multiprocessing.forkserver.ensure_running = start_then_sigterm
context = prepare_helper_start(DistContext(0, 0, 1, 1, torch.device("cpu"), distributed=True))
server = multiprocessing.forkserver._forkserver._forkserver_pid
loader = torch.utils.data.DataLoader(list(range(8)), batch_size=4, num_workers=1, multiprocessing_context=context)
print("sigterm", came, "batches", len(list(loader)), "server", server == multiprocessing.forkserver._forkserver._forkserver_pid)
"""


@pytest.mark.slow
@pytest.mark.skipif(sys.version_info >= (3, 12, 1) or (3, 11, 10) <= sys.version_info < (3, 12),
                    reason="this CPython forks loader workers without a fork server (prepare_helper_start)")
def test_a_sigterm_as_the_fork_server_starts_reaches_the_training_process_and_spares_the_server():
    """The default options start loader workers from a fork server in a process group on this
    CPython. A SIGTERM to the whole job as the server starts: the server, still before its first
    line, must outlive it (found under SLURM: it died, and the run failed on its first loader,
    "EOFError: unexpected EOF"), and the training process must act on it (it was lost when the
    process ignored SIGTERM meanwhile, and one of gloo's threads took it)."""
    result = subprocess.run([sys.executable, "-c", FORK_SERVER_SIGTERM], cwd=REPO, capture_output=True,
                            text=True, timeout=120, start_new_session=True)
    assert result.returncode == 0 and "sigterm [15] batches 2 server True" in result.stdout, result.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("distributed", [False, True])  # forked by the training process; by a fork server
def test_a_loader_worker_outlives_a_sigterm_from_outside_and_ends_on_its_trainers(distributed):
    """slurmstepd and `kill -TERM -PGID` signal the workers too: they must go on serving the
    training process, which stops at a step and saves. A SIGTERM from the training process
    itself (multiprocessing ends its children so as the process exits, then waits for them)
    still ends one."""
    ctx = DistContext(0, 0, 2, 2, torch.device("cpu"), distributed=True) if distributed else DistContext.single()
    loader = torch.utils.data.DataLoader(Slow(), batch_size=2, num_workers=1,
                                         worker_init_fn=functools.partial(start_worker, os.getpid()),
                                         multiprocessing_context=prepare_helper_start(ctx))
    batches = iter(loader)
    next(batches)
    worker = batches._workers[0]
    subprocess.run(["kill", "-TERM", str(worker.pid)], check=True)  # from another process
    time.sleep(1)
    for _ in range(5):
        next(batches)
    assert worker.is_alive()
    os.kill(worker.pid, signal.SIGTERM)  # from this one, the worker's training process
    worker.join(timeout=10)
    assert worker.exitcode == 0
    del batches
