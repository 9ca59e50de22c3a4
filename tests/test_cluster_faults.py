"""What real clusters do that a laptop does not, at the one place the code meets each: two
ranks that share a host name but not a PID namespace, a rank that fails alone, --check's
threads on a node of several GPUs, one GPU per task (`srun --gpus-per-task=1`), the store's
timeout on every rank, the user's umask, SLURM's cyclic task layout. The real processes and
schedulers are tests/test_slurm.py's, tests/test_multinode.py's and tests/test_preemption.py's."""
from __future__ import annotations

import datetime
import functools
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist
from conftest import REPO

from cluster import check, faults
from cluster.faults import FaultWatch, handling_sigterm_and_faults, process_id_view, started_at
from multi_train_utils.checkpoint import save_atomic
from multi_train_utils.distributed_utils import DistContext, init_distributed, resolve_device, prepare_helper_start
from multi_train_utils.loaders import start_worker
from processes.rendezvous import Rendezvous, find_free_port
from speed.image_cache import machine_index
from utils import Preempted, UserError


def job_store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=10))


def rank_of_two(rank: int, store: dist.Store) -> DistContext:
    return DistContext(rank, rank, 2, 2, torch.device("cpu"), distributed=True, store=store)


def view_in(*prefix: str) -> str:
    code = "from cluster.faults import process_id_view; print(process_id_view())"
    return subprocess.run([*prefix, sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          check=True).stdout.strip()


def test_a_process_id_means_something_only_in_the_same_boot_and_pid_namespace():
    ours = process_id_view()
    assert view_in() == ours  # a child, as a neighbour rank on this machine is
    own_namespace = ["unshare", "--pid", "--fork", "--mount-proc"]
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("a PID namespace of its own needs root and util-linux's unshare")
    theirs = view_in(*own_namespace)
    assert theirs != ours and theirs.split("/")[0] == ours.split("/")[0]  # the same host name, another view


def test_a_rank_under_another_pid_namespace_is_judged_by_its_count(tmp_path, monkeypatch):
    """Rank 1 says it is process 1 (its own namespace's init) of another view: rank 0 never
    looks it up in its own /proc, and names it only once its count stops (SILENT_SECONDS)."""
    monkeypatch.setattr(faults, "SILENT_SECONDS", 1.0)
    store = job_store()
    watch = FaultWatch(tmp_path, rank_of_two(0, store)).start()
    try:
        store.set("who/1", f"{process_id_view()}-elsewhere 1 -")
        beating = threading.Event()

        def beat() -> None:
            while not beating.wait(0.2):
                store.add("beat/1", 1)

        threading.Thread(target=beat, daemon=True).start()
        time.sleep(3 * faults.BEAT_SECONDS)  # the watch thread looks every second
        assert not store.check(["ended"]) and watch._ended() == []  # alive: its count moves
        beating.set()
        assert watch._ended() == [1]  # silent for SILENT_SECONDS: ended
    finally:
        watch.close()


def test_a_neighbour_is_named_only_once_its_process_is_gone_and_its_count_has_stopped(tmp_path, monkeypatch):
    """A neighbour whose process id is gone from this machine's /proc but whose count still
    moves is not named; once the count stops, the watch names it. And the converse: a process
    id that lives on (the kernel gave it to a new process) hides no rank: the id's process
    started at another time."""
    monkeypatch.setattr(faults, "SILENT_SECONDS", 1.0)
    monkeypatch.setattr(faults, "GRACE_SECONDS", 60.0)  # the watch would end this process: closed first
    store = job_store()
    store.set("who/1", f"{process_id_view()} 999999999 -")  # no such process here
    beating = threading.Event()

    def beat() -> None:
        while not beating.wait(0.2):
            store.add("beat/1", 1)

    threading.Thread(target=beat, daemon=True).start()
    watch = FaultWatch(tmp_path, rank_of_two(0, store)).start()
    try:
        time.sleep(3 * faults.BEAT_SECONDS)
        assert not store.check(["ended"])
        beating.set()
        deadline = time.monotonic() + 3 * faults.FRESH_SECONDS
        while not store.check(["ended"]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert store.get("ended").decode().startswith("rank 1 ended (found by rank 0)")
    finally:
        watch.close()

    store = job_store()
    # Rank 1's id now belongs to another process (this one, which started at another time).
    store.set("who/1", f"{process_id_view()} {os.getpid()} 1")
    store.add("beat/1", 1)
    watch = FaultWatch(tmp_path, rank_of_two(0, store)).start()
    try:
        assert watch._ended() == [1]
        store.set("who/1", f"{process_id_view()} {os.getpid()} {started_at(os.getpid())}")  # the same process
        watch.neighbours.clear()
        assert watch._ended() == [] and watch._neighbours_gone() == []
    finally:
        watch.close()


@pytest.mark.parametrize("error, marks", [(UserError("no such file: weights.pth"), "ended"),
                                         (Preempted("SIGTERM"), "finished/1")])
def test_an_error_of_one_rank_is_written_for_the_others_and_a_stop_is_not(tmp_path, error, marks):
    store = job_store()
    with pytest.raises(type(error)):
        with handling_sigterm_and_faults(tmp_path, rank_of_two(1, store)):
            raise error
    assert store.check([marks])
    if marks == "ended":
        assert "rank 1 on" in store.get("ended").decode() and "UserError: no such file" in store.get("ended").decode()
        assert not store.check(["finished/1"])
    else:
        assert not store.check(["ended"])


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
    """init_process_group sets its timeout only on a store it makes itself; every rank's store
    (a client's too, and torchrun's attempt store) must wait --dist-timeout, not 5 s."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(find_free_port()))
    ctx = init_distributed(Rendezvous(0, 0, 1, 1), "cpu", None, timeout_s=123)
    try:
        assert ctx.store.timeout == datetime.timedelta(seconds=123)
    finally:
        dist.destroy_process_group()


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
import subprocess, sys, threading, multiprocessing.forkserver, torch
from multi_train_utils.distributed_utils import DistContext, prepare_helper_start
context = prepare_helper_start(DistContext(0, 0, 2, 2, torch.device("cpu"), distributed=True))
server = multiprocessing.forkserver._forkserver._forkserver_pid
# SLURM's warning, as slurmstepd sends it (from outside), while the server still imports torch
# and this process already waits for its first worker.
threading.Timer(0.5, subprocess.run, (["kill", "-TERM", str(server)],)).start()
loader = torch.utils.data.DataLoader(list(range(8)), batch_size=4, num_workers=1, multiprocessing_context=context)
print("batches", len(list(loader)), "server", server == multiprocessing.forkserver._forkserver._forkserver_pid)
"""


@pytest.mark.skipif(sys.version_info >= (3, 12, 1) or (3, 11, 10) <= sys.version_info < (3, 12),
                    reason="this CPython forks loader workers without a fork server (prepare_helper_start)")
def test_the_fork_server_outlives_a_sigterm_from_outside_while_it_starts():
    """Found under SLURM: the time limit's warning came while the fork server, started at
    set-up, still imported torch, before it could leave SIGTERM alone; it died, and the run
    failed on its first loader ("EOFError: unexpected EOF") instead of saving its position.
    The server is started with SIGTERM blocked, as the exec keeps it."""
    result = subprocess.run([sys.executable, "-c", FORK_SERVER_SIGTERM], cwd=REPO, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0 and "batches 2 server True" in result.stdout, result.stderr[-3000:]


@pytest.mark.parametrize("distributed", [False, True])  # forked by the training process; by a fork server
def test_a_loader_worker_outlives_a_sigterm_from_outside_and_ends_on_its_trainers(distributed):
    """slurmstepd and `kill -TERM -PGID` signal the workers too: they must go on serving the
    training process, which stops at a step and saves. A SIGTERM from the training process
    itself (torch's shutdown of a worker that did not stop in time) still ends one."""
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
