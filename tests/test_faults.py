"""Faults that distributed jobs meet, done for real: killed workers, Ctrl-C, busy ports,
half-written and hostile checkpoints, peers that never answer."""
from __future__ import annotations

import argparse
import multiprocessing
import os
import re
import pickle
import random
import signal
import socket
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import (
    SAMPLE,
    STOP_WITHIN,
    copy_sample,
    metrics,
    run_cli,
    start_job,
    user_error,
    wait_for_epochs,
    wait_until_gone,
)

import train_single_gpu
from model import create_model
from multi_train_utils.checkpoint import Progress, load_checkpoint, make_checkpoint, save_atomic
from multi_train_utils.distributed_utils import init_distributed, teardown
from multi_train_utils.distributed_utils import DistContext, Ranks, find_free_port
from multi_train_utils.resume import restore_training
from outputs.run_folder import read_resume_checkpoint

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
    # lock and hang. The server imports torch once, and each writer starts as a fork of it.
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "multi_train_utils.checkpoint"])
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
    return make_checkpoint(model, optimizer, scaler, Progress(1, 0.2), argparse.Namespace(),
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
        line = user_error(train_single_gpu.main, ["--data-path", str(SAMPLE), "--resume", str(bad)], capsys)
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
        line = user_error(train_single_gpu.main, ["--data-path", str(SAMPLE), option, str(path)], capsys)
        assert reason in line, line
    assert not marker.exists(), "the pickle's payload ran"
    pickle.loads(pickle.dumps(_Payload(marker)))  # the payload is real: plain pickle runs it
    assert marker.exists()


@pytest.mark.slow
def test_spawn_child_exception_is_shown_and_the_job_ends(tmp_path):
    """An image is corrupted after start-up: the rank that reads it raises and says so, with
    its traceback, and the launcher takes the others down (mp.spawn's join)."""
    data = copy_sample(tmp_path / "data")
    proc, marker = start_job("spawn", tmp_path / "run", "--epochs", "50", data=data)
    wait_for_epochs(proc, tmp_path / "run", 1)
    # One image: the next epoch, exactly one rank reads it (in training or in evaluation).
    sorted((data / "roses").iterdir())[0].write_bytes(b"no longer a JPEG")
    seconds, err = wait_until_gone(proc, marker)
    assert proc.returncode != 0 and seconds < STOP_WITHIN
    failing = re.search(r"^rank (\d): RuntimeError: cannot decode", err, re.MULTILINE)
    assert failing, err[-3000:]
    assert "Traceback" in err and "roses" in err, err[-3000:]  # which file, and where it was read


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


def _silent_peer(rank: int, port: int, result_file: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    init_distributed(Ranks(rank, rank, 2, 2), "cpu", "gloo", 3)
    try:
        if rank == 1:
            time.sleep(30)  # alive but never joins the collective
            return
        started = time.monotonic()
        try:
            dist.all_reduce(torch.ones(1))
            outcome = "returned"
        except RuntimeError as e:
            outcome = f"raised after {time.monotonic() - started:.1f}s: {str(e)[:80]}"
        Path(result_file).write_text(outcome)
        os._exit(0)  # do not wait for the silent peer in teardown
    finally:
        teardown()


@pytest.mark.slow
def test_dist_timeout_turns_a_silent_peer_into_an_error(tmp_path):
    result = tmp_path / "result.txt"
    context = mp.spawn(_silent_peer, args=(find_free_port(), str(result)), nprocs=2, join=False)
    deadline = time.monotonic() + 60
    while not result.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    for p in context.processes:
        p.kill()
    text = result.read_text()
    assert text.startswith("raised after"), text
    assert float(text.split()[2].rstrip("s:")) < 15, text


def _reads_its_view_of_the_run_folder(rank: int, port: int, views: list[str]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    ctx = init_distributed(Ranks(rank, rank, 2, 2), "cpu", "gloo", 30)
    try:
        args = argparse.Namespace(resume="auto", model="resnet34", blurpool=False)
        try:
            read_resume_checkpoint(args, Path(views[rank]), ctx)
            outcome = "read"
        except Exception as e:
            outcome = f"{type(e).__name__}: {e}"
        Path(views[rank], "outcome.txt").write_text(outcome)
    finally:
        teardown()


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
    mp.spawn(_reads_its_view_of_the_run_folder, args=(find_free_port(), [str(v) for v in views]), nprocs=2)
    outcomes = [(view / "outcome.txt").read_text() for view in views]
    assert outcomes[0] == outcomes[1], outcomes
    assert outcomes[0].startswith(f"UserError: rank 1: cannot read checkpoint '{views[1] / 'last.pth'}'"), outcomes


# A loader worker hands a batch over as file descriptors; here the "training process" connects
# for one and drops the socket mid-handshake, as one ended by Ctrl-C does.
DROPPED_HANDOVER = """
import os, socket, sys, time
from multiprocessing import resource_sharer
if sys.argv[1] == "worker":
    from multi_train_utils.loaders import start_worker
    start_worker(os.getppid(), 0)
read_end, _ = os.pipe()
resource_sharer.DupFd(read_end)  # what torch's reduction does for a shared-memory batch
s = socket.socket(socket.AF_UNIX)
s.connect(resource_sharer._resource_sharer._address)
s.close()
time.sleep(1)  # the sharer thread reports what it got, or nothing
"""


@pytest.mark.slow
@pytest.mark.parametrize("setup", ["plain", "worker"])
def test_a_dropped_batch_handover_prints_no_traceback_in_a_loader_worker(setup):
    result = run_cli([sys.executable, "-c", DROPPED_HANDOVER, setup], timeout=60)
    assert result.returncode == 0, result.stderr
    # Without our worker setup the same drop is a traceback: the check has teeth.
    assert ("Traceback" in result.stderr) == (setup == "plain"), result.stderr


@pytest.mark.parametrize("saved_with", ["fp32", "fp16"])
def test_a_checkpoint_resumes_under_fp16_whatever_precision_saved_it(saved_with):
    """A run moved to a GPU without bf16 (or given --amp fp16) resumes a bf16 or fp32 run's
    checkpoint, whose loss scaler was off and saved nothing: its own scale starts afresh. An
    fp16 run's scale is carried over."""
    checkpoint, optimizer = _checkpoint(torch.amp.GradScaler("cpu", init_scale=1024.0, enabled=saved_with == "fp16"))
    args = argparse.Namespace(batch_size=8, accum_steps=1, epochs=3, time_budget=None)
    for enabled in (True, False):
        scaler = torch.amp.GradScaler("cpu", enabled=enabled)
        progress = restore_training({**checkpoint, "loaded_from": "last.pth"}, optimizer, scaler, None, [0] * 4,
                                    False, args, DistContext.single())
        assert progress.epoch == 1
        if enabled:
            assert scaler.get_scale() == (1024.0 if saved_with == "fp16" else 65536.0)
