"""A resumed run trains and evaluates on the files it started with, whatever happened to the
folder since: photos added are not used, photos removed are an error (or left out when the
user says so), a moved folder is followed when the user says so. Real launchers, real files."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import (
    SMALL_MODEL,
    child_pids,
    copy_sample,
    describe_processes,
    kill_group,
    metrics,
    ok,
    processes_with_marker,
    start_job,
    train,
    train_here,
    wait_for_epochs,
)

from utils import SPLIT_FILE

pytestmark = pytest.mark.slow


def recorded(out: Path) -> dict:
    return json.loads((out / SPLIT_FILE).read_text())


def started(tmp_path: Path, launcher: str = "single", nproc: int = 1) -> tuple[Path, Path]:
    """A copy of the sample, and a run of one epoch on it."""
    data = copy_sample(tmp_path / "data")
    out = tmp_path / "run"
    if launcher == "single":
        ok(train_here(out, *SMALL_MODEL, "--epochs", "1", data=data))
    else:
        ok(train(launcher, out, *SMALL_MODEL, "--epochs", "1", nproc=nproc, data=data))
    return data, out


def grow(data: Path, count: int = 10) -> None:
    """`count` new photos in daisy/: copies of tulips' under new names."""
    for i, photo in enumerate(sorted((data / "tulips").iterdir())[:count]):
        shutil.copy(photo, data / "daisy" / f"new-{i}{photo.suffix}")


def shrink(out: Path, count: int = 3) -> list[str]:
    """Remove `count` recorded photos of roses, validation ones first; their paths."""
    split = recorded(out)
    roses = split["class_names"].index("roses")
    gone = [p for p, c in split["val"] + split["train"] if c == roses][:count]
    for path in gone:
        Path(path).unlink()
    return gone


def test_photos_added_after_the_start_are_not_used(tmp_path):
    # Two processes (spawn): the split is rank 0's file, and every rank must read the same one.
    # torchrun's resume of the same file is test_preemption's.
    launcher = "spawn"
    data, out = started(tmp_path, launcher, nproc=2)
    before = recorded(out)
    grow(data)
    result = ok(train(launcher, out, *SMALL_MODEL, "--epochs", "2", "--resume", "auto", nproc=2, data=data))
    after = recorded(out)
    assert (after["train"], after["val"]) == (before["train"], before["val"])
    assert f"10 image(s) added to {data} since the run started are not used" in result.stdout
    first, second = metrics(out)
    assert second["val_total"] == first["val_total"] == len(before["val"])


def test_photos_removed_after_the_start_stop_the_resume_and_nothing_is_overwritten(tmp_path, capsys):
    data, out = started(tmp_path)
    files = {name: (out / name).read_bytes() for name in (SPLIT_FILE, "last.pth", "metrics.jsonl")}
    gone = shrink(out)
    result = train_here(out, *SMALL_MODEL, "--epochs", "2", "--resume", "auto", data=data)
    assert result.returncode == 2, result.stderr
    (line,) = [line for line in result.stderr.splitlines() if line.strip()]
    assert line.startswith("error: 3 of the run's 120 files are gone or no longer decode")
    assert all(path in line for path in gone) and "--drop-missing" in line
    assert {name: (out / name).read_bytes() for name in files} == files


def test_drop_missing_goes_on_without_them_and_keeps_the_rest_of_the_split(tmp_path):
    data, out = started(tmp_path)
    before = recorded(out)
    gone = set(shrink(out))
    grow(data)
    result = ok(train_here(out, *SMALL_MODEL, "--epochs", "2", "--resume", "auto", "--drop-missing", data=data))
    after = recorded(out)
    assert after["val"] == [s for s in before["val"] if s[0] not in gone]
    assert after["train"] == [s for s in before["train"] if s[0] not in gone]
    removed_val = sum(s[0] in gone for s in before["val"])
    assert (f"--drop-missing: left out {3 - removed_val} training and {removed_val} validation image(s)"
            in result.stdout)
    assert metrics(out)[1]["val_total"] == len(before["val"]) - removed_val


def test_a_moved_folder_is_followed_when_the_user_says_so(tmp_path):
    data, out = started(tmp_path)
    before = recorded(out)
    moved = tmp_path / "elsewhere" / "flowers"
    moved.parent.mkdir()
    data.rename(moved)
    refused = train_here(out, *SMALL_MODEL, "--epochs", "2", "--resume", "auto", data=moved)
    assert refused.returncode == 2 and "--data-moved" in refused.stderr
    result = ok(train_here(out, *SMALL_MODEL, "--epochs", "2", "--resume", "auto", "--data-moved", data=moved))
    assert f"the run's files are read under {moved}" in result.stdout
    after = recorded(out)
    assert after["data_path"] == str(moved.resolve())
    assert [Path(p).relative_to(moved).as_posix() for p, _ in after["val"]] == \
        [Path(p).relative_to(data).as_posix() for p, _ in before["val"]]


def test_a_run_folder_from_before_split_json_resumes_with_a_warning(tmp_path):
    data, out = started(tmp_path)
    (out / SPLIT_FILE).unlink()
    result = ok(train_here(out, *SMALL_MODEL, "--epochs", "2", "--resume", "auto", data=data))
    assert "does not exist (a run folder from before runs recorded their files)" in result.stdout
    assert [r["epoch"] for r in metrics(out)] == [1, 2]


def finished_after_killing_a_worker(proc: subprocess.Popen, marker: str, timeout: float = 60) -> str:
    """kill -9 one worker of an elastic torchrun job: torchrun restarts the group, which must
    resume and finish with nothing left running. Its stdout. A job that does not finish within
    `timeout` is killed whole, its processes described."""
    workers = child_pids(proc.pid)
    assert len(workers) == 2, workers
    os.kill(workers[0], signal.SIGKILL)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        states = describe_processes(processes_with_marker(marker))
        for pid in processes_with_marker(marker):
            os.kill(pid, signal.SIGKILL)
        kill_group(proc)
        stdout, stderr = proc.communicate()
        raise AssertionError(f"the restarted job did not finish within {timeout} s:\n{states}\n{stderr[-3000:]}") from None
    assert proc.returncode == 0, stderr[-3000:]
    assert "resumed from" in stdout
    assert not processes_with_marker(marker)
    return stdout


def test_an_elastic_restart_keeps_its_split_while_the_folder_grows(tmp_path):
    """kill -9 a torchrun worker after the folder gained photos: torchrun restarts the group,
    which resumes from last.pth on the recorded files, not on a fresh split of the folder, and
    finishes every epoch; metrics.jsonl holds each epoch once."""
    data = copy_sample(tmp_path / "data")
    out = tmp_path / "run"
    proc, marker = start_job("launch", out, "--epochs", "3", "--resume", "auto", data=data, max_restarts=1)
    wait_for_epochs(proc, out, 1)
    while not (out / "last.pth").exists() and proc.poll() is None:  # written after epoch 1's line in metrics.jsonl
        time.sleep(0.01)
    before = recorded(out)
    grow(data)
    stdout = finished_after_killing_a_worker(proc, marker)
    assert f"10 image(s) added to {data} since the run started are not used" in stdout
    after = recorded(out)
    assert (after["train"], after["val"]) == (before["train"], before["val"])
    assert [r["epoch"] for r in metrics(out)] == [1, 2, 3]
    assert {r["val_total"] for r in metrics(out)} == {len(before["val"])}
