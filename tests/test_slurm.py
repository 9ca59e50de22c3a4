"""The repository's flowers.sbatch under a real SLURM (tests/slurm_cluster.py), fitted to one
node of 2 CPU tasks and run with the default loader workers: the time limit's warning (the
script's --signal=B:...@N, which the script passes on to every process of the job step as
SIGTERM) stops every task after the same step, rank 0 writes preempted.txt, the script requeues
the job, and the job goes on from that step, until a task killed ends the job, srun naming it; a
plain scancel leaves the position for a new job, which ends the run. Skipped, with the reason,
where SLURM cannot start."""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import pytest
from conftest import REPO, SAMPLE, SMALL_MODEL, metrics
from slurm_cluster import start_cluster

from multi_train_utils.checkpoint import load_checkpoint

TASKS = 2
# The tasks' options past the script's own: small and quick, 6 steps of 8 images per task and epoch.
SMALL = ["--img-size", "32", "--batch-size", "8", "--no-plots", *SMALL_MODEL]
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}


@pytest.fixture(scope="module")
def cluster():
    # Not under pytest's temporary folders, which only their owner may enter: munged runs as munge.
    folder = Path(tempfile.mkdtemp(prefix="slurm-"))
    folder.chmod(0o755)
    try:
        cluster, reason = start_cluster(folder / "cluster")
        if cluster is None:
            pytest.skip(reason)
        yield cluster
        cluster.stop()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def batch_script(runs: Path, epochs: int, python: str = sys.executable) -> str:
    """flowers.sbatch, fitted to this machine: one node, no GPUs, one CPU per task (the default
    loader workers: one per task), this interpreter, the bundled sample and small sizes."""
    script = (REPO / "flowers.sbatch").read_text()
    fitted = (script.replace("--nodes=2", "--nodes=1")
              .replace("--ntasks-per-node=4", f"--ntasks-per-node={TASKS}")
              .replace("--cpus-per-task=8", "--cpus-per-task=1")
              .replace(" python ", f" {python} ")
              .replace("DATA=${DATA:-dataset/flower_photos}", f"DATA={SAMPLE}")
              .replace("runs/flowers-", f"{runs}/flowers-")
              .replace("--dist-timeout 300", f"--dist-timeout 300 --epochs {epochs} {' '.join(SMALL)}"))
    fitted = "\n".join(line for line in fitted.splitlines() if "--gpus-per-node" not in line) + "\n"
    assert fitted.count(str(SAMPLE)) == 1 and f"--epochs {epochs}" in fitted, fitted
    return fitted


def submit(cluster, tmp_path: Path, epochs: int, run_dir: Path | None = None,
           limit: tuple[str, int] | None = None, python: str = sys.executable) -> tuple[str, Path, Path]:
    """The job's id, its run folder (`run_dir`: an earlier job's, as the script's RUN_DIR) and
    its output file. `limit`: the script's time limit and its warning's seconds, in place of
    its own (an hour, 120 s)."""
    script = tmp_path / "flowers.sbatch"
    text = batch_script(tmp_path, epochs, python)
    if limit:
        text, warnings = re.subn(r"(--signal=(?:B:)?\w+@)120\b", rf"\g<1>{limit[1]}",
                                 text.replace("--time=01:00:00", f"--time={limit[0]}"))
        assert warnings == 1 and f"--time={limit[0]}" in text, text
    script.write_text(text)
    export = [f"--export=ALL,RUN_DIR={run_dir}"] if run_dir else []
    job = cluster.run("sbatch", "--parsable", f"--chdir={REPO}", f"--output={tmp_path}/slurm-%j.out", *export,
                      str(script)).stdout.strip().split(";")[0]
    return job, run_dir or tmp_path / f"flowers-{job}", tmp_path / f"slurm-{job}.out"


def wait_for(cluster, job: str, output: Path, done, what: str, timeout: float = 300) -> dict[str, str]:
    """Poll the job until `done(fields)`; its `scontrol show job` fields."""
    deadline = time.monotonic() + timeout
    while True:
        fields = cluster.job(job)
        if done(fields):
            return fields
        if time.monotonic() > deadline or (fields["JobState"] in FINAL_STATES and not done(fields)):
            text = output.read_text()[-5000:] if output.exists() else "(no output)"
            raise AssertionError(f"job {job}: {what} not reached; {fields.get('JobState')}, "
                                 f"restarts {fields.get('Restarts')}, reason {fields.get('Reason')}, "
                                 f"exit code {fields.get('ExitCode')}:\n{text}\n{cluster.logs()}")
        time.sleep(0.5)


def epochs_logged(run: Path) -> int:
    return len(metrics(run)) if (run / "metrics.jsonl").exists() else 0


@pytest.mark.slow
def test_the_time_limits_warning_requeues_the_job_which_goes_on_and_a_killed_task_ends_it(cluster, tmp_path):
    """The script's own `--signal=B:...@N` before its time limit, sent by SLURM to the batch
    script, whose trap passes it on to every process of the job step (`scancel --signal=TERM`).
    slurmctld looks at time limits every 30 s and sends the warning at the first look less than
    N + 30 s before the limit (measured here): with a 2-minute limit and USR1@60, 30 to 60 s into
    the job. The job has more epochs than any of these machines trains in that time, and once
    epoch 1 is logged its tasks are held (hold_until_signalled): the warning finds them in
    training whatever the machine's speed. Every task stops after the same step, rank 0 writes
    preempted.txt, the script requeues the job, and the job, given a longer limit while it waits,
    goes on from that step. Then rank 0 is SIGKILLed once that epoch is logged (it hosts the store):
    srun names the task, --kill-on-bad-exit ends the others, and the job fails within a minute,
    last.pth whole."""
    job, run, output = submit(cluster, tmp_path, epochs=1000, limit=("00:02:00", 60))
    wait_for(cluster, job, output, lambda f: epochs_logged(run) >= 1, "epoch 1")
    hold_until_signalled(cluster, job)
    wait_for(cluster, job, output, lambda f: f["JobState"] == "PENDING" and f["Restarts"] == "1", "the requeue",
             timeout=240)
    # Not again in the second attempt: what a user would do for a job that needs more time.
    cluster.run("scontrol", "update", f"JobId={job}", "TimeLimit=10")
    log = output.read_text()
    stops = re.findall(r"stopped: SIGTERM: every process stopped after step (\d+) of epoch (\d+)", log)
    assert len(stops) == TASKS and len(set(stops)) == 1, log[-4000:]  # every task, after the same step
    step, epoch = map(int, stops[0])
    assert not [line for line in log.splitlines() if line.startswith("error:")], log[-4000:]  # srun's own are "srun: error:"
    # It starts again by itself, cred_expire + 1 seconds after the requeue (16 s here, 121 s by default).
    wait_for(cluster, job, output, lambda f: f"epoch {epoch} goes on after step {step}" in output.read_text(),
             "the resumed epoch")
    wait_for(cluster, job, output, lambda f: epochs_logged(run) >= epoch, "the resumed epoch's end")
    logged = [m["epoch"] for m in metrics(run)]
    assert logged == list(range(1, len(logged) + 1)) and len(logged) >= epoch  # each epoch logged once
    assert not (run / "preempted.txt").exists()  # the requeued script's first line removed it

    os.kill(task_pid(job, rank=0), signal.SIGKILL)
    killed = time.monotonic()
    fields = wait_for(cluster, job, output, lambda f: f["JobState"] in FINAL_STATES, "the end", timeout=120)
    log = output.read_text()
    assert time.monotonic() - killed < 60, log[-4000:]
    assert fields["JobState"] == "FAILED" and fields["ExitCode"] != "0:0", (fields, log[-4000:])
    assert re.search(r"srun: error: .*: task 0: Killed", log), log[-4000:]
    # Whole, and at least the stop's position; killed as it wrote the next epoch's (metrics.jsonl's line
    # goes first), it may be one epoch behind metrics.jsonl, whose extra line a resumed run drops.
    checkpoint = load_checkpoint(run / "last.pth")
    assert (checkpoint["epoch"], checkpoint["steps_in_epoch"]) >= (epoch - 1, step)
    assert checkpoint["epoch"] <= len(metrics(run)) <= checkpoint["epoch"] + 1


@pytest.mark.slow
def test_a_plain_scancel_saves_the_position_and_a_new_job_goes_on_from_it(cluster, tmp_path):
    """`scancel JOB` without --signal: SLURM sends SIGTERM to the batch script and to every
    process of the job step, then SIGKILL after KillWait (30 s, as by default). The tasks are held
    (SIGSTOP) once epoch 1 is logged until the signal waits in each, so that it finds them in
    training. Every task stops after the same step and rank 0 saves the position; the job ends
    CANCELLED, not requeued. A new job given the old run folder (the script's RUN_DIR) goes on
    from that step to the last epoch."""
    job, run, output = submit(cluster, tmp_path, epochs=2)
    wait_for(cluster, job, output, lambda f: epochs_logged(run) >= 1, "epoch 1")
    hold_until_signalled(cluster, job, then=lambda: cluster.run("scancel", job))
    fields = wait_for(cluster, job, output, lambda f: f["JobState"] in FINAL_STATES or f["Restarts"] != "0",
                      "the end, or a requeue", timeout=120)
    log = output.read_text()
    if fields["Restarts"] != "0":
        cluster.run("scancel", job, check=False)  # requeued: not to run again
    stops = re.findall(r"stopped: SIGTERM: every process stopped after step (\d+) of epoch (\d+)", log)
    assert len(stops) == TASKS and len(set(stops)) == 1, log[-4000:]
    step, epoch = map(int, stops[0])
    checkpoint = load_checkpoint(run / "last.pth")
    assert (checkpoint["epoch"], checkpoint["steps_in_epoch"]) == (epoch - 1, step), log[-4000:]
    assert (run / "preempted.txt").is_file()
    assert fields["JobState"] == "CANCELLED" and fields["Restarts"] == "0", (
        {k: fields[k] for k in ("JobState", "Restarts", "ExitCode")}, log[-4000:])

    again, _, again_output = submit(cluster, tmp_path, epochs=2, run_dir=run)
    wait_for(cluster, again, again_output, lambda f: f["JobState"] == "COMPLETED", "the end")
    log = again_output.read_text()
    assert f"goes on after step {step}" in log, log[-4000:]
    assert not [line for line in log.splitlines() if line.startswith("error:")], log[-4000:]
    assert [m["epoch"] for m in metrics(run)] == [1, 2]  # each epoch logged once
    assert load_checkpoint(run / "last.pth")["epoch"] == 2
    assert not (run / "preempted.txt").exists()  # the script's first line removes the last attempt's


@pytest.mark.slow
def test_a_task_failing_at_start_up_ends_the_job_failed_and_not_requeued(cluster, tmp_path):
    """Task 1 is given a --data-path that does not exist (the data missing on one node) and ends
    at once, with its own error line and 2; srun (--kill-on-bad-exit) then sends SIGTERM to task
    0, which is still importing torch (slowed several-fold by tracemalloc, as from a slow shared
    file system) and ends by it. No time limit's warning came: the job ends FAILED and is not
    requeued, as it would be again and again while the data stays missing."""
    python = tmp_path / "python"  # this interpreter, with task 1's data path replaced, task 0 slowed
    python.write_text(f'#!/bin/sh\ncase "$SLURM_PROCID" in\n  1) set -- "$@" --data-path {tmp_path}/missing ;;\n'
                      f'  0) set -- -X tracemalloc "$@" ;;\nesac\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    job, run, output = submit(cluster, tmp_path, epochs=2, python=str(python))
    fields = wait_for(cluster, job, output, lambda f: f["JobState"] in FINAL_STATES or f["Restarts"] != "0",
                      "the end, or a requeue", timeout=180)
    log = output.read_text()
    if fields["Restarts"] != "0" or fields["JobState"] not in FINAL_STATES:
        cluster.run("scancel", job, check=False)  # requeued: not to run again
    assert fields["JobState"] == "FAILED" and fields["Restarts"] == "0", (
        {k: fields[k] for k in ("JobState", "Restarts", "ExitCode")}, log[-4000:])
    assert f"error: data folder '{tmp_path}/missing' does not exist" in log and "task 1: Exited with exit code 2" in log, log[-4000:]
    assert not (run / "last.pth").exists() and not (run / "preempted.txt").exists()


def hold_until_signalled(cluster, job: str, then=None) -> None:
    """Stop the job's training processes (SIGSTOP), do `then` (a scancel), and let them go on
    (SIGCONT) once SLURM's SIGTERM waits in each, to take it as they would have in training.
    Without `then`, until the time limit's warning: the 30 to 60 s wait for it then costs none of
    the CPU the rest of the suite needs (about 90 CPU-s on 2 cores), and only where the job has
    run less than 25 s, so that the warning is still to come. slurmstepd may send a SIGCONT with
    its signal (the processes then go on by themselves, the SIGTERM taken); 50 s at most, well
    before the time limit."""
    hours, minutes, seconds = map(int, cluster.job(job)["RunTime"].split("-")[-1].split(":"))
    if then is None and hours * 3600 + minutes * 60 + seconds >= 25:
        return
    pids = [task_pid(job, rank) for rank in range(TASKS)]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not all(stopped(pid) for pid in pids):
            time.sleep(0.1)
        if then is not None:
            then()
        deadline = time.monotonic() + 50
        while time.monotonic() < deadline and all(stopped(pid) for pid in pids):
            if all(sigterm_pending(pid) for pid in pids):
                break
            time.sleep(0.5)
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def sigterm_pending(pid: int) -> bool:
    """Whether a SIGTERM waits in the process: its bit in the pending sets /proc shows."""
    fields = dict(line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":\t" in line)
    return bool((int(fields["ShdPnd"], 16) | int(fields["SigPnd"], 16)) & (1 << (signal.SIGTERM - 1)))


def stopped(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"
    except OSError:
        return False


def task_pid(job: str, rank: int) -> int:
    """The training process of task `rank` of `job`: the process whose environment holds that
    job and rank, and whose parent does not (a loader worker's or fork server's parent does)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = dict(v.split(b"=", 1) for v in (entry / "environ").read_bytes().split(b"\0") if b"=" in v)
            cmdline = (entry / "cmdline").read_bytes()
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if (env.get(b"SLURM_JOB_ID") == job.encode() and env.get(b"SLURM_PROCID") == str(rank).encode()
                and b"train_multi_gpu_using_launch.py" in cmdline):
            found[int(entry.name)] = parent
    # The one slurmstepd started: the others are its helpers (loader workers, the fork server's children).
    pids = [pid for pid, parent in found.items() if parent not in found and comm(parent) == "slurmstepd"]
    assert len(pids) == 1, found
    return pids[0]


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""
