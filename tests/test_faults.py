"""Faults that distributed jobs meet, done for real: killed workers, busy ports, half-written
and hostile checkpoints, peers that stop answering."""
from __future__ import annotations

import argparse
import contextlib
import datetime
import multiprocessing
import os
import re
import pickle
import random
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import (
    FAST_DEFAULT_WORKERS,
    SAMPLE,
    STOP_WITHIN,
    child_pids,
    copy_sample,
    describe_processes,
    free_port,
    kill_group,
    metrics,
    processes_with_marker,
    start_job,
    user_error,
    wait_for_epochs,
    wait_until_gone,
)

import train_single_gpu
from model import create_model
from multi_train_utils.checkpoint import load_checkpoint, make_checkpoint, save_atomic
from multi_train_utils.distributed_utils import DistContext, Ranks, process_context
from multi_train_utils.resume import read_checkpoint, restore_training
from multi_train_utils.train_eval_utils import Extras, Progress

def _save_forever(path: str) -> None:
    ramp = torch.arange(4_000_000, dtype=torch.float64)  # 32 MB: each save takes a while, so kills land mid-write
    i = 0
    while True:
        i += 1
        save_atomic({"i": i, "w": ramp + i}, Path(path))


@pytest.mark.slow
def test_killed_while_saving_leaves_a_whole_checkpoint(tmp_path):
    """SIGKILL a process that does nothing but save, at random moments: the file on disk is
    always one whole checkpoint, never a torn mix or a truncated write. A kill that lands
    mid-write leaves its temporary file behind, which proves the test hit the moment it is about."""
    path = tmp_path / "last.pth"
    # A fork server, not a fork: a fork of this multi-threaded test process can inherit a held
    # lock and hang. The server imports torch once, and each writer starts as a fork of it. A process
    # has one fork server, its modules those of whoever starts it first: the loaders' own here
    # (loader_options), for a later test's loader workers in this process to fork from the server a run has.
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["multi_train_utils.fork_server", "torch", "torchvision", "my_dataset"])
    mid_write = 0
    for _ in range(8):
        previous = path.stat().st_ino if path.exists() else None
        left_before = len(list(tmp_path.glob("*.tmp")))  # by earlier kills
        writer = ctx.Process(target=_save_forever, args=(str(path),))
        writer.start()
        deadline = time.monotonic() + 60
        # This writer's first save must have landed (a rename gives the file a new inode) before
        # a kill means anything: until then it is still starting up, far from any write.
        while not path.exists() or path.stat().st_ino == previous:
            assert writer.is_alive() and time.monotonic() < deadline, "the writer never saved"
            time.sleep(0.01)
        time.sleep(random.uniform(0.0, 0.5))
        os.kill(writer.pid, signal.SIGKILL)
        writer.join()
        mid_write += len(list(tmp_path.glob("*.tmp"))) > left_before
        state = torch.load(path, weights_only=True)  # raises on a truncated file
        i = state["i"]
        assert state["w"][0].item() == i and state["w"][-1].item() == 3_999_999 + i
    assert not [p for p in tmp_path.iterdir() if p.name != "last.pth" and not p.name.endswith(".tmp")]
    assert mid_write >= 1, "no kill landed while a checkpoint was being written"


def _checkpoint(scaler: torch.amp.GradScaler) -> tuple[dict, torch.optim.Optimizer]:
    """A real checkpoint of ResNet34 after epoch 1, with `scaler`'s state; and its optimizer."""
    model = create_model(5)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return make_checkpoint(model, optimizer, scaler, Progress(epoch=1, best_acc=0.2), argparse.Namespace(),
                           ["daisy", "dandelion", "roses", "sunflowers", "tulips"], world_size=1), optimizer


def _real_checkpoint(path: Path) -> None:
    save_atomic(_checkpoint(torch.amp.GradScaler("cpu", enabled=False))[0], path)


def test_truncated_or_corrupt_checkpoint_is_a_clear_error(tmp_path, capsys):
    good = tmp_path / "last.pth"
    _real_checkpoint(good)
    load_checkpoint(good)  # the untouched file is fine
    truncated = tmp_path / "truncated.pth"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    corrupt = tmp_path / "corrupt.pth"
    data = bytearray(good.read_bytes())
    data[100:4000] = os.urandom(3900)
    corrupt.write_bytes(bytes(data))
    for bad in (truncated, corrupt):
        line = user_error(train_single_gpu.main, ["--data-path", str(SAMPLE), "--output-dir", str(tmp_path / "run"),
                                                  "--resume", str(bad)], capsys)
        assert "cannot read checkpoint" in line


class _Payload:
    """Unpickling this runs `touch MARKER`: what a hostile checkpoint would do."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("option", ["--weights", "--resume"])
def test_hostile_pickle_is_refused_and_runs_nothing(tmp_path, option, capsys):
    marker = tmp_path / "payload_ran"
    hostile = tmp_path / "hostile.pth"
    with open(hostile, "wb") as f:
        pickle.dump({"model": _Payload(marker)}, f)
    torch.save({"model": {"fc.weight": _Payload(marker)}}, tmp_path / "hostile_zip.pth")
    # A bare pickle is not torch's file format; a torch.save file reaches the unpickler and is refused there.
    for path, reason in ((hostile, "not a PyTorch file"), (tmp_path / "hostile_zip.pth", "refused as unsafe")):
        line = user_error(train_single_gpu.main, ["--data-path", str(SAMPLE), "--output-dir", str(tmp_path / "run"),
                                                  option, str(path)], capsys)
        assert reason in line, line
    assert not marker.exists(), "the pickle's payload ran"
    pickle.loads(pickle.dumps(_Payload(marker)))  # the payload is real: plain pickle runs it
    assert marker.exists()


def ended_within(proc, marker: str, seconds: float) -> tuple[int | None, str, str]:
    """The job's exit code (None: still running after `seconds`) and stderr, and what is left of
    it then (each process's state, where the kernel has it waiting), every process of it killed."""
    try:
        _, err = proc.communicate(timeout=seconds)
        deadline = time.monotonic() + 5
        while processes_with_marker(marker) and time.monotonic() < deadline:
            time.sleep(0.1)
    except subprocess.TimeoutExpired:
        err = ""
    left = describe_processes(processes_with_marker(marker))
    for pid in processes_with_marker(marker):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    kill_group(proc)
    if not err:
        err = proc.communicate()[1]
    return proc.returncode if not left else None, err, left


@pytest.mark.slow
def test_an_image_that_does_not_decode_stops_the_run_when_drawn(tmp_path):
    """By default images are not decoded at start-up: a file that does not decode stops the run
    when a loader worker draws it (the default workers), with the traceback that names it and
    what leaves such files out, exit 1, within STOP_WITHIN seconds, no process left."""
    data = copy_sample(tmp_path / "data")
    sorted((data / "roses").iterdir())[0].write_bytes(b"not a JPEG")
    proc, marker = start_job("single", tmp_path / "run", "--epochs", "1", nproc=1, data=data, fast=FAST_DEFAULT_WORKERS)
    code, err, left = ended_within(proc, marker, STOP_WITHIN)
    assert not left, f"the job did not end; left running:\n{left}\n{err[-2000:]}"
    assert code == 1, (code, err[-3000:])
    assert "DataLoader worker process" in err and "RuntimeError: cannot decode" in err and "roses" in err, err[-3000:]
    assert "--check-images leaves out the files that do not decode" in err


@pytest.mark.slow
def test_spawn_child_exception_is_shown_and_the_job_ends(tmp_path):
    """An image is corrupted after start-up: the rank whose loader worker reads it raises and says
    so, with the traceback that names the file, and the launcher takes the others down (mp.spawn's
    join), loader workers included, within STOP_WITHIN seconds."""
    data = copy_sample(tmp_path / "data")
    proc, marker = start_job("spawn", tmp_path / "run", "--epochs", "50", data=data, fast=FAST_DEFAULT_WORKERS)
    wait_for_epochs(proc, tmp_path / "run", 1)
    # One image: the next epoch, exactly one rank reads it (in training or in evaluation).
    sorted((data / "roses").iterdir())[0].write_bytes(b"no longer a JPEG")
    code, err, left = ended_within(proc, marker, STOP_WITHIN)
    assert not left, f"the job did not end; left running:\n{left}\n{err[-2000:]}"
    assert code == 1, (code, err[-3000:])
    assert "DataLoader worker process" in err and "RuntimeError: cannot decode" in err and "roses" in err, err[-3000:]


@pytest.mark.slow
def test_two_spawn_jobs_at_once_with_the_default_ports_taken(tmp_path):
    held = []
    for port in (29500, 29501, 29400):
        s = socket.socket()
        try:
            s.bind(("127.0.0.1", port))
            s.listen()
            held.append(s)
        except OSError:
            s.close()  # already taken by someone else: just as good
    try:
        jobs = [start_job("spawn", tmp_path / name, "--epochs", "1") for name in ("a", "b")]
        for proc, _ in jobs:
            out, err = proc.communicate(timeout=180)
            assert proc.returncode == 0, err[-3000:]
    finally:
        for s in held:
            s.close()
    assert len(metrics(tmp_path / "a")) == len(metrics(tmp_path / "b")) == 1


@pytest.mark.slow
def test_dist_timeout_turns_a_silent_peer_into_an_error(tmp_path):
    """A peer that stops answering, alive (SIGSTOP: a hung node, a process stuck in a driver):
    the other rank's next collective fails after --dist-timeout instead of waiting for ever, and
    the spawn launcher ends the job, the stopped process included."""
    proc, marker = start_job("spawn", tmp_path, "--epochs", "50", "--dist-timeout", "12", fast=FAST_DEFAULT_WORKERS)
    wait_for_epochs(proc, tmp_path, 1)
    workers = sorted(pid for pid in child_pids(proc.pid) if "resource_tracker" not in cmdline(pid))
    assert len(workers) == 2, workers
    os.kill(workers[1], signal.SIGSTOP)  # rank 1: mp.spawn starts the ranks in order
    stopped = time.monotonic()
    try:
        _, err = proc.communicate(timeout=90)
    finally:
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        wait_until_gone(proc, marker)
    waited = time.monotonic() - stopped
    assert proc.returncode == 1 and 12 <= waited < 12 + STOP_WITHIN + 15, (proc.returncode, waited, err[-3000:])
    assert re.search(r"^Traceback", err, re.MULTILINE), err[-3000:]  # rank 0's
    assert re.search(r"timed out|timeout", err, re.IGNORECASE), err[-1500:]  # gloo's, after --dist-timeout


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _reads_its_view_of_the_run_folder(rank: int, port: int, views: list[str]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    ctx = process_context(Ranks(rank, rank, 2, 2), "cpu")
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=30))
    try:
        args = argparse.Namespace(resume="auto", model="resnet34", blurpool=False, eval_only=False)
        try:
            read_checkpoint(args, Path(views[rank]), ctx)
            outcome = "read"
        except Exception as e:
            outcome = f"{type(e).__name__}: {e}"
        Path(views[rank], "outcome.txt").write_text(outcome)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_a_rank_that_cannot_read_the_checkpoint_stops_every_rank(tmp_path):
    """--resume auto across machines: rank 0 finds last.pth, and a shared file system that has
    not caught up shows rank 1 a half-copied one (its own view of the run folder here). Every
    rank stops with rank 1's reason, none waits alone in the next collective."""
    views = [tmp_path / "rank0", tmp_path / "rank1"]
    for view in views:
        view.mkdir()
    _real_checkpoint(views[0] / "last.pth")
    (views[1] / "last.pth").write_bytes((views[0] / "last.pth").read_bytes()[:100_000])
    mp.spawn(_reads_its_view_of_the_run_folder, args=(free_port(), [str(v) for v in views]), nprocs=2)
    outcomes = [(view / "outcome.txt").read_text() for view in views]
    assert outcomes[0] == outcomes[1], outcomes
    assert outcomes[0].startswith(f"UserError: rank 1: cannot read checkpoint '{views[1] / 'last.pth'}'"), outcomes


@pytest.mark.parametrize("saved_with", ["fp32", "fp16"])
def test_a_checkpoint_resumes_under_fp16_whatever_precision_saved_it(saved_with):
    """A run moved to a GPU without bf16 (or given --amp fp16) resumes a bf16 or fp32 run's
    checkpoint, whose loss scaler was off and saved nothing: its own scale starts afresh. An
    fp16 run's scale is carried over."""
    checkpoint, optimizer = _checkpoint(torch.amp.GradScaler("cpu", init_scale=1024.0, enabled=saved_with == "fp16"))
    args = argparse.Namespace(batch_size=8, accum_steps=1, epochs=3, time_budget=None)
    for enabled in (True, False):
        scaler = torch.amp.GradScaler("cpu", enabled=enabled)
        progress = restore_training({**checkpoint, "loaded_from": "last.pth"}, Progress(last_epoch=3), optimizer, scaler,
                                    Extras(), [0] * 4, False, args, DistContext.single())
        assert progress.epoch == 1
        if enabled:
            assert scaler.get_scale() == (1024.0 if saved_with == "fp16" else 65536.0)
