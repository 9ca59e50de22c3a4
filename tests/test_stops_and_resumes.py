"""A job ended from outside, at any moment, and taken up again: a SIGTERM while the processes
still meet ends them at once; a run killed as rank 0 saves an epoch logs that epoch once; a rank
that cannot read best.pth for the report stops every rank with its reason. (A model with dropout
stopped and resumed: tests/test_preemption.py's jobs of two processes.)"""
from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import (
    FAST_DEFAULT_WORKERS,
    SAMPLE,
    SMALL_MODEL,
    free_port,
    kill_group,
    metrics,
    ok,
    start,
    train_here,
)

import train_single_gpu
from model import create_model
from multi_train_utils.checkpoint import (
    load_checkpoint,
    make_checkpoint,
    save_checkpoint,
)
from multi_train_utils.config import get_args_parser
from multi_train_utils.distributed_utils import DistContext
from multi_train_utils.train_eval_utils import Progress
from outputs.report import report_on_best
from utils import UserError

# A SLURM job's tasks get SIGKILL KillWait (30 s by default) after SIGTERM: a process that
# answers only after a wait in C++ loses its requeue.
ENDS_WITHIN = 5


def wait_for(condition, proc: subprocess.Popen, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None or time.monotonic() > deadline:
            kill_group(proc)
            out, err = proc.communicate()
            raise AssertionError(f"{what}: not seen\nstdout:\n{out[-2000:]}\nstderr:\n{err[-3000:]}")
        time.sleep(0.05)


@pytest.mark.slow
def test_a_sigterm_while_the_processes_meet_ends_them_at_once(tmp_path):
    """srun's tasks (here the torchrun launcher given RANK and WORLD_SIZE, as srun's are, with no
    agent), one of three missing: rank 0 waits in its store for it, rank 1 with it. A SIGTERM, as
    srun sends when a task fails or the job is cancelled, ends each at once, by the signal: no
    position to save before training, no exit 75 that a job script would take for a preemption."""
    port = free_port()
    procs = []
    for rank in (0, 1):
        env = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "3",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(start([sys.executable, "train_multi_gpu_using_launch.py", "--data-path", str(SAMPLE),
                            "--output-dir", str(tmp_path), *FAST_DEFAULT_WORKERS, "--dist-timeout", "300"], env))
    try:
        store = None

        def rank_1_joined() -> bool:
            nonlocal store
            try:
                store = store or dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=2))
                return store.check(["joined/1"])
            except dist.DistError:
                return False

        wait_for(rank_1_joined, procs[0], "rank 1 at rank 0's store")
        time.sleep(1)  # both well inside their waits
        assert all(p.poll() is None for p in procs)
        started = time.monotonic()
        for p in procs:
            p.send_signal(signal.SIGTERM)
        codes = [p.wait(timeout=60) for p in procs]
        seconds = time.monotonic() - started
    finally:
        for p in procs:
            kill_group(p)
    assert codes == [-signal.SIGTERM] * 2, [p.stderr.read()[-2000:] for p in procs]
    assert seconds < ENDS_WITHIN, seconds
    assert not (tmp_path / "preempted.txt").exists()


@pytest.mark.slow
@pytest.mark.parametrize("dies", ["before", "after"])
def test_a_run_killed_as_it_saves_an_epoch_logs_that_epoch_once(tmp_path, monkeypatch, dies):
    """The process dies as rank 0 saves epoch 2's checkpoint: before last.pth is in place (the
    resumed run trains epoch 2 again, and logs it once), or just after (the run has logged it
    already: its line is written before the checkpoint)."""
    def save_then_die(checkpoint, output_dir, is_best=False):
        if checkpoint["epoch"] == 2 and dies == "before":
            raise OSError("killed")
        save_checkpoint(checkpoint, output_dir, is_best)
        if checkpoint["epoch"] == 2:
            raise OSError("killed")

    out = tmp_path / "run"
    monkeypatch.setattr(train_single_gpu, "save_checkpoint", save_then_die)
    assert train_here(out, "--epochs", "3", *SMALL_MODEL).returncode == 1
    assert [m["epoch"] for m in metrics(out)] == [1, 2]
    assert load_checkpoint(out / "last.pth")["epoch"] == (1 if dies == "before" else 2)
    monkeypatch.undo()
    ok(train_here(out, "--epochs", "3", "--resume", "auto", *SMALL_MODEL))
    assert [m["epoch"] for m in metrics(out)] == [1, 2, 3]


def _reports_from_its_view(rank: int, port: int, views: list[str]) -> None:
    """One rank of a gloo job whose run folder (`views[rank]`, as its node's file system shows
    it) holds best.pth, whole or not; what report_on_best did, written beside it."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    ctx = DistContext(rank, rank, 2, 2, torch.device("cpu"), distributed=True)
    args = get_args_parser("test").parse_args(["--data-path", str(SAMPLE), "--model", "resnet18"])
    try:
        report_on_best(create_model(5, "resnet18"), [], None, Path(views[rank]), args, ctx)
        outcome = "reported"
    except (UserError, RuntimeError) as e:  # torch's DistError is a RuntimeError
        outcome = f"{type(e).__name__}: {e}"
    Path(views[rank], "outcome.txt").write_text(outcome)
    dist.destroy_process_group()


@pytest.mark.slow
def test_a_rank_that_cannot_read_best_pth_for_the_report_stops_every_rank(tmp_path):
    """--report after a resume whose best epoch ran before it: every rank loads best.pth itself,
    and a shared file system that has not caught up shows rank 1 half of it. Both ranks stop with
    rank 1's reason, at once; before, rank 0 went on into the report's collectives alone and
    waited there until --dist-timeout."""
    views = [tmp_path / "rank0", tmp_path / "rank1"]
    model = create_model(5, "resnet18")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    checkpoint = make_checkpoint(model, optimizer, torch.amp.GradScaler("cpu", enabled=False), Progress(epoch=1),
                                 get_args_parser("test").parse_args(["--data-path", str(SAMPLE)]),
                                 ["daisy", "dandelion", "roses", "sunflowers", "tulips"], world_size=2)
    for view in views:
        view.mkdir()
    save_checkpoint(checkpoint, views[0], is_best=True)
    (views[1] / "best.pth").write_bytes((views[0] / "best.pth").read_bytes()[:100_000])
    mp.spawn(_reports_from_its_view, args=(free_port(), [str(v) for v in views]), nprocs=2)
    outcomes = [(view / "outcome.txt").read_text() for view in views]
    assert outcomes[0] == outcomes[1], outcomes
    assert outcomes[0].startswith(f"UserError: rank 1: cannot read checkpoint '{views[1] / 'best.pth'}'"), outcomes
