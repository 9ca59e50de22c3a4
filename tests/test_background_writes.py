"""Rank 0's epoch files written beside the training loop (run_folder.EpochWriter): the copy it
writes is the state at the hand-over, a failed write surfaces in the loop, and a process killed
at any moment of a write leaves the previous last.pth whole."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import REPO

from multi_train_utils.checkpoint import load_checkpoint
from multi_train_utils.run_folder import TENSORBOARD_SCALARS, EpochWriter


def checkpoint_at(epoch: int, values: torch.Tensor) -> dict:
    return {"model": {"w": values}, "optimizer": {}, "scaler": {}, "epoch": epoch, "best_acc": 0.0, "args": {},
            "class_names": ["a", "b"]}


def record_of(epoch: int) -> dict:
    return {"epoch": epoch, **{key: 0.0 for key in TENSORBOARD_SCALARS}}


def test_the_file_holds_the_state_at_the_hand_over(tmp_path):
    """Training changes the weights in place right after handing them over; the file must not."""
    weights = torch.zeros(1000)
    with EpochWriter(tmp_path) as files:
        files.save_epoch(checkpoint_at(1, weights), record_of(1), is_best=True)
        weights += 1  # the next steps
        files.save_epoch(checkpoint_at(2, weights), record_of(2), is_best=False)
        weights += 1
    assert torch.equal(load_checkpoint(tmp_path / "best.pth")["model"]["w"], torch.zeros(1000))
    assert torch.equal(load_checkpoint(tmp_path / "last.pth")["model"]["w"], torch.ones(1000))
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["epoch"] for line in lines] == [1, 2] and all(line["checkpoint_seconds"] >= 0 for line in lines)


def test_a_write_that_fails_raises_in_the_loop(tmp_path):
    """The error of a background write (here: a state torch.save cannot pickle) reaches the
    training loop at its next hand-over, and the previous epoch's files stay."""
    files = EpochWriter(tmp_path)
    files.save_epoch(checkpoint_at(1, torch.zeros(3)), record_of(1), is_best=False)
    files.save_epoch({**checkpoint_at(2, torch.ones(3)), "args": {"bad": lambda: None}}, record_of(2), is_best=False)
    with pytest.raises(Exception, match="pickle"):
        files.save_epoch(checkpoint_at(3, torch.ones(3)), record_of(3), is_best=False)
    files.__exit__(None, None, None)
    assert load_checkpoint(tmp_path / "last.pth")["epoch"] == 1
    assert not list(tmp_path.glob(".*.tmp"))  # the failed write removed its temporary file


# Hands over checkpoints of 8 MB as fast as they are written, and says each hand-over.
WRITER = """
import sys, torch
from pathlib import Path
from multi_train_utils.run_folder import TENSORBOARD_SCALARS, EpochWriter
with EpochWriter(Path(sys.argv[1])) as files:
    for epoch in range(1, 10_000):
        state = {"model": {"w": torch.full((2_000_000,), float(epoch))}, "optimizer": {}, "scaler": {},
                 "epoch": epoch, "best_acc": 0.0, "args": {}, "class_names": ["a", "b"]}
        files.save_epoch(state, {"epoch": epoch, **{k: 0.0 for k in TENSORBOARD_SCALARS}}, is_best=epoch % 2 == 1)
        print(epoch, flush=True)
"""


@pytest.mark.slow
def test_a_kill_at_any_moment_of_a_write_leaves_whole_files(tmp_path):
    """SIGKILLed at moments spread over a write (each hand-over waits for the write before), the
    process leaves last.pth and best.pth whole, each one epoch's state; metrics.jsonl names no
    epoch after last.pth's; and what is left over is what the next run's start removes. (SIGTERM
    stops a training run at a step instead: tests/test_preemption.py.)"""
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
        assert torch.equal(last["model"]["w"], torch.full((2_000_000,), float(last["epoch"])))
        best = load_checkpoint(out / "best.pth")
        assert best["epoch"] % 2 == 1 and best["model"]["w"][0] == best["epoch"] <= last["epoch"]
        epochs = [json.loads(line)["epoch"] for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert epochs == list(range(1, len(epochs) + 1)) and len(epochs) in (last["epoch"] - 1, last["epoch"])
        # Temporary files of the write that was cut off: prepare_output_dir's pattern removes them.
        assert all(p.match(".*.pth*.tmp") for p in out.glob(".*"))
