"""Rank 0's epoch files written beside the training loop (run_folder.RunFiles): the copy it
writes is the state at the hand-over, a failed write surfaces in the loop, and a process killed
at any moment of a write leaves the previous last.pth whole."""
from __future__ import annotations

import argparse
import gc
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO

from multi_train_utils.checkpoint import copy_atomic, load_checkpoint
from multi_train_utils.config import Plan
from multi_train_utils.distributed_utils import DistContext, keep_inherited_objects
from multi_train_utils.progress import Progress
from multi_train_utils.train_eval_utils import Evaluation
from outputs import run_folder
from outputs.run_folder import CheckpointWriteFailed, RunFiles
from utils import DataSplit

TRAIN_STATS = {"train_loss": 1.0, "train_acc": 0.5, "epoch_images": 8, "train_images": 8, "lr": 0.1, "seconds": 1.0,
               "data_wait_seconds": 0.0}
EVALUATED = Evaluation({"val_loss": 1.0, "val_acc": 0.5, "val_correct": 1, "val_total": 2}, "model", [], None, 0.5)


def run_files(out, model: torch.nn.Module) -> tuple[RunFiles, Progress]:
    """Rank 0's files of a run training `model`, as a launcher makes them (no plots)."""
    args = argparse.Namespace(plots=False, batch_size=4, accum_steps=1, output_dir=str(out))
    split = DataSplit(["a", "b"], [("a/1.jpg", 0)], [("b/1.jpg", 1)])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    progress = Progress(last_epoch=10_000)
    return RunFiles(out, Plan(args, "test", ["a", "b"], []), split, "data", progress, model, optimizer,
                    torch.amp.GradScaler("cpu", enabled=False), None, DistContext.single()), progress


def save(files: RunFiles, progress: Progress, epoch: int, is_best: bool) -> None:
    progress.finish_epoch(epoch, 0.5, TRAIN_STATS, 0.5)
    files.save_epoch(epoch, progress, TRAIN_STATS, EVALUATED, is_best)


def test_the_file_holds_the_state_at_the_hand_over(tmp_path):
    """Training changes the weights in place right after handing them over; the file must not."""
    model = torch.nn.Linear(100, 10, bias=False)
    torch.nn.init.zeros_(model.weight)
    files, progress = run_files(tmp_path, model)
    with files, torch.no_grad():
        save(files, progress, 1, is_best=True)
        model.weight += 1  # the next steps
        save(files, progress, 2, is_best=False)
        model.weight += 1
    assert torch.equal(load_checkpoint(tmp_path / "best.pth")["model"]["weight"], torch.zeros(10, 100))
    assert torch.equal(load_checkpoint(tmp_path / "last.pth")["model"]["weight"], torch.ones(10, 100))
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["epoch"] for line in lines] == [1, 2] and all(line["checkpoint_seconds"] >= 0 for line in lines)
    assert json.loads((tmp_path / "split.json").read_text())["class_names"] == ["a", "b"]


def test_a_write_that_fails_raises_in_the_loop(tmp_path):
    """The error of a background write (here: a state torch.save cannot pickle) reaches the
    training loop at its next hand-over, and the previous epoch's files stay."""
    files, progress = run_files(tmp_path, torch.nn.Linear(3, 1))
    files.__enter__()  # entered as a launcher's `with` enters it; left by hand below, after the failure
    save(files, progress, 1, is_best=False)
    files.args.bad = lambda: None  # the configuration, which every checkpoint holds, no longer pickles
    save(files, progress, 2, is_best=False)
    del files.args.bad
    with pytest.raises(CheckpointWriteFailed, match="pickle"):
        save(files, progress, 3, is_best=False)
    files.__exit__(None, None, None)
    assert load_checkpoint(tmp_path / "last.pth")["epoch"] == 1
    assert not list(tmp_path.glob(".*.tmp"))  # the failed write removed its temporary file


# Hands over checkpoints of 8 MB as fast as they are written, and says each hand-over.
WRITER = """
import sys, torch
from pathlib import Path
sys.path.insert(0, "tests")
from test_background_writes import run_files, save
model = torch.nn.Linear(1000, 2000, bias=False)
files, progress = run_files(Path(sys.argv[1]), model)
with files, torch.no_grad():
    for epoch in range(1, 10_000):
        model.weight.fill_(float(epoch))
        save(files, progress, epoch, is_best=epoch % 2 == 1)
        print(epoch, flush=True)
"""


@pytest.mark.slow
def test_a_kill_at_any_moment_of_a_write_leaves_whole_files(tmp_path):
    """SIGKILLed at moments spread over a write (each hand-over waits for the write before), the
    process leaves last.pth and best.pth whole, each one epoch's state, best.pth never behind
    last.pth's best epoch; metrics.jsonl names no epoch after last.pth's; and what is left over
    is what the next run's start removes. (SIGTERM stops a training run at a step instead:
    tests/test_preemption.py.)"""
    for trial in range(4):
        out = tmp_path / f"trial-{trial}"
        out.mkdir()
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(out)], cwd=REPO, stdout=subprocess.PIPE, text=True)
        handed_over = [proc.stdout.readline() for _ in range(3)]  # writing steadily by now
        assert all(line.strip() for line in handed_over), proc.communicate()
        time.sleep(0.011 * trial)  # a write takes about 0.04 s here
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
        last = load_checkpoint(out / "last.pth")
        assert torch.equal(last["model"]["weight"], torch.full((2000, 1000), float(last["epoch"])))
        best = load_checkpoint(out / "best.pth")
        # best.pth is written before last.pth: at most one epoch ahead of it, never behind its best.
        assert best["epoch"] % 2 == 1 and best["model"]["weight"][0, 0] == best["epoch"] <= last["epoch"] + 1
        assert best["epoch"] >= last["epoch"] - 1
        epochs = [json.loads(line)["epoch"] for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert epochs == list(range(1, len(epochs) + 1)) and len(epochs) in (last["epoch"] - 1, last["epoch"])
        # Temporary files of the write that was cut off: prepare_output_dir's pattern removes them.
        assert all(p.match(".*.pth*.tmp") for p in out.glob(".*"))


def test_a_run_files_object_writes_nothing_until_entered(tmp_path):
    """Made, it has written nothing and started nothing: the run's first files appear when the
    launcher's `with` enters it."""
    files, _ = run_files(tmp_path, torch.nn.Linear(3, 1))
    assert not list(tmp_path.iterdir())
    with files:
        assert {"config.json", "class_indices.json", "split.json"} <= {p.name for p in tmp_path.iterdir()}


def test_a_full_disk_at_sigterms_save_is_named_too(tmp_path, monkeypatch):
    """torch.save reports a full disk as a RuntimeError from its zip writer, not an OSError:
    the stopped run's save says what failed and the room left, as an epoch's does."""
    files, progress = run_files(tmp_path, torch.nn.Linear(3, 1))
    files.__enter__()

    def full(*_):
        raise RuntimeError("[enforce fail at inline_container.cc:644] . unexpected pos 1984 vs 1872")

    monkeypatch.setattr(run_folder, "save_atomic", full)
    with pytest.raises(CheckpointWriteFailed, match="could not write epoch 1's checkpoint .* GiB free there"):
        files.save_position(progress)
    files.__exit__(None, None, None)


def test_best_pth_copied_where_links_fail_is_on_disk_before_the_rename(tmp_path, monkeypatch):
    """On a file system without hard links best.pth is a copy: its bytes are synced before the
    rename makes them best.pth, as last.pth's are."""
    (tmp_path / "last.pth").write_bytes(b"checkpoint bytes")
    synced = []
    real_fsync = os.fsync

    def no_links(*_):
        raise OSError("no hard links here")

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "link", no_links)
    monkeypatch.setattr(os, "fsync", fsync)
    copy_atomic(tmp_path / "last.pth", tmp_path / "best.pth")
    assert (tmp_path / "best.pth").read_bytes() == b"checkpoint bytes"
    assert str(tmp_path / ".best.pth.tmp") in synced


class Finalized:
    """An object in a reference cycle whose finalizer leaves a mark: garbage for the collector."""

    def __init__(self, mark: Path):
        self.mark, self.cycle = mark, self

    def __del__(self):
        self.mark.write_text(f"collected in process {os.getpid()}")


def collect_in_child() -> None:
    keep_inherited_objects()  # what a plotter and a loader worker do first
    gc.collect()


def test_a_forked_helper_never_collects_what_it_inherited(tmp_path):
    """A plotter or loader worker forked from a process that holds uncollected garbage must not
    run its finalizers: one of a library's thread pool waits on a lock of a thread the fork left
    behind (seen: a plotter hung for ever in onnxruntime's, inside the test process)."""
    gc.disable()  # the garbage must still be there at the fork
    try:
        Finalized(tmp_path / "mark")
        child = multiprocessing.get_context("fork").Process(target=collect_in_child)
        child.start()
        child.join(30)
        assert child.exitcode == 0 and not (tmp_path / "mark").exists()
        gc.collect()
        assert (tmp_path / "mark").read_text() == f"collected in process {os.getpid()}"
    finally:
        gc.enable()
