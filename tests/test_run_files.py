"""Rank 0's epoch files, written inline by the launcher's own lines: metrics.jsonl's line first,
then the checkpoints, best.pth before last.pth (a hard link to it), each renamed into place; a
process killed at any moment leaves a run that `--resume auto` goes on from, whose metrics.jsonl
then names each epoch once. (SIGTERM stops a training run at a step instead:
tests/test_preemption.py; a write that fails: tests/test_fault_matrix.py.)"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import FAST, SAMPLE, SMALL_MODEL, kill_group, metrics, ok, start, train

from multi_train_utils.checkpoint import load_checkpoint, make_checkpoint, save_checkpoint
from multi_train_utils.distributed_utils import DistContext
from multi_train_utils.resume import read_checkpoint
from multi_train_utils.run_folder import write_run_files
from multi_train_utils.train_eval_utils import Progress
from utils import DataSplit

RUN = ["--data-path", str(SAMPLE), *FAST, *SMALL_MODEL]


def lines_of(path: Path) -> int:
    try:
        return sum(1 for line in path.read_text().splitlines() if line.strip())
    except OSError:
        return 0


def inode(path: Path) -> int | None:
    try:
        return path.stat().st_ino
    except OSError:
        return None


def snapshot(out: Path) -> tuple[int, int | None, int | None, tuple[str, ...]]:
    """metrics.jsonl's lines, last.pth's and best.pth's inodes (a rename gives a new one), and the
    temporary files of the writes under way."""
    return (lines_of(out / "metrics.jsonl"), inode(out / "last.pth"), inode(out / "best.pth"),
            tuple(sorted(p.name for p in out.glob(".*.pth.tmp"))))


@pytest.mark.slow
def test_an_epochs_line_comes_before_its_checkpoints_and_best_pth_before_last_pth(tmp_path):
    """A real run of 3 epochs, its folder watched every millisecond: at every moment metrics.jsonl
    names at least the epochs last.pth holds, and while a checkpoint is written it names the epoch
    being saved; epoch 1 (the best so far) writes best.pth first, then last.pth as a hard link to
    it. Each epoch's line was seen before its checkpoint: the order, not only its outcome."""
    out = tmp_path / "run"
    proc = start([sys.executable, "train_single_gpu.py", "--output-dir", str(out), *RUN, "--epochs", "3"])
    seen, deadline = [], time.monotonic() + 300
    try:
        while proc.poll() is None:
            assert time.monotonic() < deadline, "the run did not end"
            now = snapshot(out) if out.exists() else (0, None, None, ())
            if not seen or now != seen[-1]:
                seen.append(now)
            time.sleep(0.001)
        stdout, stderr = proc.communicate()
    finally:
        kill_group(proc)
    assert proc.returncode == 0, stderr[-3000:]
    saved, last, logged_first = 0, None, set()
    for lines, last_inode, best_inode, writing in seen:
        if last_inode != last:
            saved, last = saved + 1, last_inode
        assert lines >= saved, seen  # no checkpoint of an epoch metrics.jsonl does not name yet
        if writing:
            assert lines == saved + 1, seen  # the epoch being saved is logged already
        if lines == saved + 1:
            logged_first.add(lines)
        if saved == 0 and best_inode is not None:
            assert last_inode is None  # epoch 1: best.pth first
        if saved == 1 and lines == 1:
            assert last_inode == best_inode, seen  # last.pth: a hard link to best.pth
    assert saved == 3 and [r["epoch"] for r in metrics(out)] == [1, 2, 3]
    assert logged_first == {1, 2, 3}, seen
    assert not list(out.glob(".*.tmp"))


def killed_while_saving(out: Path, epoch: int, *extra: str) -> None:
    """A run (or a resumed one) SIGKILLed, every process of it, while it writes epoch `epoch`'s
    checkpoint: metrics.jsonl names that epoch, and the write has begun."""
    proc = start([sys.executable, "train_single_gpu.py", "--output-dir", str(out), *RUN, "--epochs", "2",
                  "--resume", "auto", *extra])
    deadline = time.monotonic() + 300
    try:
        while not (lines_of(out / "metrics.jsonl") == epoch and list(out.glob(".*.pth.tmp"))):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.0005)
        os.killpg(proc.pid, signal.SIGKILL)  # a lost node, an out-of-memory kill of the job
        proc.wait(timeout=60)
    finally:
        kill_group(proc)


@pytest.mark.slow
def test_a_kill_while_an_epoch_is_saved_leaves_a_run_that_resumes_and_logs_each_epoch_once(tmp_path):
    """Killed as epoch 1's checkpoint is written (its line logged, no last.pth yet): `--resume auto`
    finds nothing to go on from and starts the run again, its metrics.jsonl afresh. Killed again as
    epoch 2's is written: last.pth is epoch 1's, whole, and the resumed run drops epoch 2's line,
    trains epoch 2 again and logs it once. The cut-off writes leave only temporary files, which
    the next run removes."""
    out = tmp_path / "run"
    killed_while_saving(out, 1)
    assert not (out / "last.pth").exists() and [r["epoch"] for r in metrics(out)] == [1]
    killed_while_saving(out, 2)
    assert load_checkpoint(out / "last.pth")["epoch"] == 1  # whole: the previous epoch's
    assert load_checkpoint(out / "best.pth")["epoch"] in (1, 2)
    assert [r["epoch"] for r in metrics(out)] == [1, 2]
    result = ok(train("single", out, *SMALL_MODEL, "--epochs", "2", "--resume", "auto"))
    assert "resumed from" in result.stdout and "1 epoch(s) done" in result.stdout
    assert [r["epoch"] for r in metrics(out)] == [1, 2]  # each epoch once
    assert load_checkpoint(out / "last.pth")["epoch"] == 2
    assert not list(out.glob(".*.tmp"))


def test_a_resumed_run_keeps_the_epochs_its_checkpoint_holds_and_a_new_run_starts_afresh(tmp_path):
    """metrics.jsonl after a kill: lines of epochs the checkpoint holds, one after it (logged, not
    saved), and one cut short mid-append. Resumed, the run keeps the first; a new run in the
    folder (no checkpoint to go on from) starts metrics.jsonl empty."""
    model = torch.nn.Linear(2, 2)
    args = argparse.Namespace(model="resnet34", blurpool=False, eval_only=False, resume="auto")
    checkpoint = make_checkpoint(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                 torch.amp.GradScaler("cpu", enabled=False), Progress(epoch=2), args, ["a", "b"], 1)
    save_checkpoint(checkpoint, tmp_path)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"epoch": e}) + "\n" for e in (1, 2, 3)) + '{"epo')
    assert read_checkpoint(args, tmp_path, DistContext.single())["epoch"] == 2
    assert [r["epoch"] for r in metrics(tmp_path)] == [1, 2]
    split = DataSplit(["a", "b"], [("a/1.jpg", 0)], [("b/1.jpg", 1)])
    write_run_files(tmp_path, args, "single", split, "data", DistContext.single(), Progress(epoch=2))
    assert [r["epoch"] for r in metrics(tmp_path)] == [1, 2]  # resumed: kept
    write_run_files(tmp_path, args, "single", split, "data", DistContext.single(), Progress())
    assert not (tmp_path / "metrics.jsonl").exists()  # a new run: afresh


def test_last_pth_where_links_fail_is_on_disk_before_the_rename(tmp_path, monkeypatch):
    """On a file system without hard links last.pth holds best.pth's bytes all the same, synced
    before the rename makes them last.pth, as best.pth's are."""
    synced = []
    real_fsync = os.fsync

    def no_links(*_):
        raise OSError("no hard links here")

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "link", no_links)
    monkeypatch.setattr(os, "fsync", fsync)
    save_checkpoint({"epoch": 1, "weights": torch.arange(10)}, tmp_path, is_best=True)
    assert (tmp_path / "last.pth").read_bytes() == (tmp_path / "best.pth").read_bytes()
    assert str(tmp_path / ".best.pth.tmp") in synced
    assert str(tmp_path / ".last.pth.tmp") in synced
