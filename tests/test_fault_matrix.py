"""The fault matrix: what each fault a real run meets does to the job, on loopback with gloo,
started as users start it: a dead rank (rank 0 included) ends the job within a minute on every
launcher, and the launcher names it; an srun task missing at the start is named once
--dist-timeout has passed; a SIGTERM at any moment of the setup ends every process at once, by
the signal (there is nothing to save before training); an IPv6 rendezvous works; a failed
checkpoint write stops the run (docs/troubleshooting.md lists each message beside the symptom a
user would search for)."""
from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
import time
import uuid
from pathlib import Path

import pytest
from conftest import (FAST, FAST_DEFAULT_WORKERS, SAMPLE, SMALL_MODEL, STOP_WITHIN, child_pids, describe_processes,
                      free_port, kill_group, launcher_cmd, metrics, processes_with_marker, run_cli, start, train_here)

from cluster import check
from multi_train_utils.checkpoint import load_checkpoint, save_atomic

TRAIN = ["--data-path", str(SAMPLE), *FAST, "--epochs", "1"]
# The default loader workers: processes of their own, which must end with the job.
TRAIN_DEFAULT_WORKERS = ["--data-path", str(SAMPLE), *FAST_DEFAULT_WORKERS, "--epochs", "1"]


def env_ranks(rank: int, world_size: int, port: int, address: str = "127.0.0.1") -> dict[str, str]:
    """One process of a job started from torchrun's environment variables, by hand: no agent
    watches it, and it meets at rank 0's store (cluster/rendezvous.job_store), as srun's tasks do."""
    return {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank), "MASTER_ADDR": address,
            "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}


def srun_ranks(rank: int, world_size: int, port: int, address: str = "127.0.0.1") -> dict[str, str]:
    """One task of a job as `srun --ntasks=N` starts it (and flowers.sbatch exports MASTER_ADDR and
    MASTER_PORT): it meets at rank 0's store (cluster/rendezvous.job_store)."""
    return {"SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank), "SLURM_NTASKS": str(world_size),
            "SLURM_NNODES": "1", "MASTER_ADDR": address, "MASTER_PORT": str(port), "GLOO_SOCKET_IFNAME": "lo"}


def start_ranks(out: Path, ranks: list[int], world_size: int, *extra: str, address: str = "127.0.0.1",
                marker: str = "", train: list[str] = TRAIN, environment=env_ranks) -> list:
    port = free_port(address)
    cmd = [sys.executable, "train_multi_gpu_using_launch.py", "--output-dir", str(out), *train, *extra]
    return [start(cmd, env={**environment(rank, world_size, port, address), "TEST_JOB_MARKER": marker})
            for rank in ranks]


def finish(procs: list, timeout: float = 60, marker: str | None = None) -> list[tuple[int, str, str]]:
    """(exit code, stdout, stderr) of each process, each given `timeout` seconds from now; with
    the job's `marker`, no process of the job may be left once they have ended."""
    deadline, results, left = time.monotonic() + timeout, [], []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            results.append((proc.returncode, out, err))
        while marker and (left := processes_with_marker(marker)) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        for proc in procs:
            kill_group(proc)
    assert not left, f"processes of the job left running: {describe_processes(left)}"
    return results


def no_traceback(*texts: str) -> None:
    for text in texts:
        assert "Traceback" not in text, text


def workers_of(proc) -> list[int]:
    """The training processes a launcher started (torchrun's workers, mp.spawn's processes), in
    rank order: the first is rank 0."""
    deadline = time.monotonic() + 60
    while len(pids := [p for p in child_pids(proc.pid) if "resource_tracker" not in cmdline(p)]) < 2:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.1)
    return sorted(pids)


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["env", "launch", "spawn"])
def test_rank_0_killed_in_training_ends_the_job_within_a_minute_and_is_named(launcher, tmp_path):
    """Rank 0 SIGKILLed in training (an out-of-memory kill, a lost node): it hosts the store
    under env ranks, srun and the spawn launcher, so the others lose both their peer and their
    store. Every other process ends within a minute, non-zero, and no process of the job is
    left, loader workers included (the default options); torchrun's summary and the spawn launcher name rank 0 (under srun, srun does:
    tests/test_slurm.py)."""
    long = [*SMALL_MODEL, "--epochs", "30"]
    marker = uuid.uuid4().hex
    if launcher == "env":
        procs = start_ranks(tmp_path, [0, 1], 2, *long, marker=marker, train=TRAIN_DEFAULT_WORKERS)
        victim = procs[0].pid
    else:
        procs = [start(launcher_cmd(launcher, 2) + ["--output-dir", str(tmp_path), *TRAIN_DEFAULT_WORKERS, *long],
                       env={"TEST_JOB_MARKER": marker})]
    deadline = time.monotonic() + 180
    while not (tmp_path / "metrics.jsonl").exists():
        assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, finish(procs)
        time.sleep(0.1)
    if launcher != "env":
        victim = workers_of(procs[0])[0]
    os.kill(victim, signal.SIGKILL)
    killed = time.monotonic()
    results = finish(procs, timeout=60, marker=marker)
    assert time.monotonic() - killed < 60
    codes = [code for code, _, _ in results]
    assert all(code != 0 for code in codes), codes
    err = results[-1][2]
    if launcher == "launch":
        assert "rank      : 0" in err and "Signal 9 (SIGKILL)" in err, err[-3000:]
    if launcher == "spawn":
        assert "process 0 was killed by SIGKILL" in err, err[-3000:]


@pytest.mark.slow
def test_a_task_missing_at_the_start_is_named_and_a_check_says_so_on_every_rank(tmp_path):
    """srun task 2 of 3 never starts: rank 0, which hosts the store the tasks meet at, names it
    once --dist-timeout has passed (not torch's silence), and the other task ends too. --check,
    the same within --check-timeout (started from torchrun's variables): rank 0's table names
    it; rank 1 says that rank 0 ended the check."""
    procs = start_ranks(tmp_path / "run", [0, 1], 3, "--dist-timeout", "5", environment=srun_ranks)
    (code0, _, err0), (code1, _, err1) = finish(procs)
    assert code0 == 1 and re.search(r"2 of 3 processes joined at 127.0.0.1:\d+ within 5 s \(--dist-timeout\); "
                                    r"missing: rank 2", err0), err0[-2000:]
    assert code1 != 0
    no_traceback(err0)
    procs = start_ranks(tmp_path / "check", [0, 1], 3, "--check", "--check-timeout", "4")
    (code0, out0, err0), (code1, out1, err1) = finish(procs)
    assert code0 == code1 == 1
    no_traceback(out0, err0, out1, err1)
    assert "check: a job would not run (rendezvous)" in out0 and "missing: rank 2" in out0
    assert "rank 0 ended the rendezvous" in err1 and "missing: rank 2" in err1


@pytest.mark.slow
def test_ranks_that_read_different_checkpoints_stop_before_they_train(tmp_path):
    """A shared file system that has not caught up shows one rank an older last.pth (given here
    as another --resume file to rank 1): the ranks compare the positions they read and stop,
    naming both, instead of hanging or training apart. The first run meets at MASTER_ADDR=::1:
    torch's own store takes IPv6 addresses, and so does the job."""
    first = tmp_path / "run"
    procs = start_ranks(first, [0, 1], 2, *SMALL_MODEL, "--epochs", "2", address="::1")
    assert [code for code, _, _ in finish(procs, timeout=180)] == [0, 0]
    older = tmp_path / "older.pth"
    port = free_port()
    cmd = [sys.executable, "train_multi_gpu_using_launch.py", "--output-dir", str(tmp_path / "resumed"), *TRAIN,
           *SMALL_MODEL, "--epochs", "3"]
    checkpoint = load_checkpoint(first / "last.pth")
    save_atomic({**checkpoint, "epoch": checkpoint["epoch"] - 1}, older)  # as the epoch before left it
    procs = [start([*cmd, "--resume", str(path)], env=env_ranks(rank, 2, port))
             for rank, path in ((0, first / "last.pth"), (1, older))]
    results = finish(procs, timeout=120)
    for code, _, err in results:
        assert code == 2 and "the ranks read different checkpoints" in err, err[-3000:]
        assert "rank 0: epoch 2 step 0, rank 1: epoch 1 step 0" in err, err[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("launcher, phase", [("single", "config: "), ("spawn", "process group: "),
                                             ("launch", "images in 5 classes")])
def test_a_sigterm_during_setup_ends_every_process_at_once(launcher, phase, tmp_path):
    """SIGTERM to every process of the job (as slurmstepd and torchrun's killpg send it), the
    default loader workers among them, as a phase of the setup starts: the rendezvous, listing
    the images, the --cache fill. Before the training loop there is no position to save and no
    handler: every training process ends by the signal at once, before the first step, and no
    process of the job is left. The job's code: 143 from the spawn launcher, which names the
    signal; -15 from the single process; torchrun's own 1, its summary naming SIGTERM."""
    nproc = 1 if launcher == "single" else 2
    marker = uuid.uuid4().hex
    proc = start(launcher_cmd(launcher, nproc) + ["--output-dir", str(tmp_path), *TRAIN_DEFAULT_WORKERS, "--cache"],
                 env={"TEST_JOB_MARKER": marker})
    try:
        for line in proc.stdout:
            if phase in line:
                os.killpg(proc.pid, signal.SIGTERM)
                signalled = time.monotonic()
                break
        (code, out, err), = finish([proc], timeout=STOP_WITHIN, marker=marker)
    finally:
        kill_group(proc)
    assert time.monotonic() - signalled < STOP_WITHIN
    assert "epoch 1/1" not in out and "stopped: SIGTERM" not in err, err[-3000:]
    assert not (tmp_path / "last.pth").exists() and not (tmp_path / "preempted.txt").exists()
    if launcher == "single":
        assert code == -signal.SIGTERM and "Traceback" not in err, (code, err[-3000:])
    elif launcher == "spawn":
        assert code == 128 + signal.SIGTERM and "Traceback" not in err, (code, err[-3000:])
        assert re.search(r"^error: process [01] was killed by SIGTERM$", err, re.MULTILINE), err[-3000:]
    else:  # torchrun, signalled itself, raises torch's SignalException: its own traceback, exit 1
        assert code == 1 and "SIGTERM" in err, (code, err[-3000:])


@pytest.mark.slow
def test_a_sigterm_to_the_spawn_launcher_once_its_processes_started_ends_them_at_once(tmp_path):
    """The launcher alone signalled once it has started its processes and waits for them (join_processes'
    handler set), while they set up (a scheduler that signals a job's main process): it passes the
    signal on, they end by it at once (nothing to save before training), and the launcher ends
    with 143, naming the signal; nothing is left running."""
    marker = uuid.uuid4().hex
    proc = start(launcher_cmd("spawn", 2) + ["--output-dir", str(tmp_path), *TRAIN_DEFAULT_WORKERS],
                 env={"TEST_JOB_MARKER": marker})
    try:
        workers_of(proc)
        deadline = time.monotonic() + 60
        # rendezvous.join_processes waits for them, in poll(): mp.spawn has handed each its plan.
        while "poll" not in Path(f"/proc/{proc.pid}/wchan").read_text():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.001)
        proc.send_signal(signal.SIGTERM)
        (code, out, err), = finish([proc], timeout=STOP_WITHIN, marker=marker)
    finally:
        kill_group(proc)
    assert code == 128 + signal.SIGTERM, (code, err[-3000:])
    assert re.search(r"^error: process [01] was killed by SIGTERM$", err, re.MULTILINE), err[-3000:]
    assert "epoch 1/1" not in out and not (tmp_path / "last.pth").exists()


@pytest.mark.slow
def test_a_sigterm_to_the_spawn_launcher_while_it_starts_its_processes_leaves_none_running(tmp_path):
    """The launcher alone signalled while mp.spawn starts its processes: rank 0 started, rank 1 not
    yet given its plan. The job must end at once and leave no process behind. The moment is made
    exact: the images' plan, which mp.spawn pickles for each process, is made larger than a pipe
    holds (600 long file names), so the launcher waits in its write until rank 1 reads it, and
    rank 1 is held (SIGSTOP) as it appears, until the launcher has had the signal."""
    photo = sorted((SAMPLE / "daisy").iterdir())[0]
    for name in ("a", "b"):
        (tmp_path / "data" / name).mkdir(parents=True)
        for i in range(300):
            (tmp_path / "data" / name / f"{i:04d}_{'x' * 150}.jpg").symlink_to(photo)
    for attempt in range(3):  # on a busy machine rank 1 may read its plan before the test holds it: again
        marker = uuid.uuid4().hex
        proc = start(launcher_cmd("spawn", 2) + ["--data-path", str(tmp_path / "data"), "--output-dir",
                                                 str(tmp_path / "run"), *FAST_DEFAULT_WORKERS, "--epochs", "1"],
                     env={"TEST_JOB_MARKER": marker})
        try:
            deadline = time.monotonic() + 60
            while len(started := [p for p in child_pids(proc.pid) if "resource_tracker" not in cmdline(p)]) < 2:
                assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
                time.sleep(0.0005)
            rank_1 = max(started)
            os.kill(rank_1, signal.SIGSTOP)
            time.sleep(0.2)
            # The launcher waits in its write of rank 1's plan, in mp.spawn, which join_processes has not yet followed.
            if "pipe_write" not in Path(f"/proc/{proc.pid}/wchan").read_text():
                continue
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(timeout=STOP_WITHIN)
            os.kill(rank_1, signal.SIGCONT)
            deadline = time.monotonic() + STOP_WITHIN
            while (left := processes_with_marker(marker)) and time.monotonic() < deadline:
                time.sleep(0.1)
            states = describe_processes(left)
            break
        finally:
            kill_group(proc)
            for pid in processes_with_marker(marker):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
    else:
        pytest.skip("rank 1 read its plan before the test could hold it, 3 times: the moment was not made")
    assert code in (-signal.SIGTERM, 128 + signal.SIGTERM), code
    assert not left, f"processes of the job left running after the launcher ended ({code}):\n{states}"


@pytest.mark.slow
def test_a_damaged_split_json_is_a_clear_error_and_writes_are_whole(tmp_path):
    """A split.json cut short (by a kill during a write of an older version) stops a resume
    with one line that says what to do, not a JSONDecodeError; the run folder's JSON files are
    written beside and renamed over, so that a kill leaves the old file or the new."""
    from conftest import train_here
    from utils import write_json
    run = tmp_path / "run"
    assert train_here(run, "--epochs", "1").returncode == 0
    split = run / "split.json"
    split.write_text(split.read_text()[:100])
    result = train_here(run, "--epochs", "2", "--resume", "auto")
    assert result.returncode == 2 and "split.json is damaged" in result.stderr, result.stderr[-2000:]
    write_json(tmp_path / "a.json", {"x": 1})
    assert not list(tmp_path.glob(".*.tmp")) and (tmp_path / "a.json").read_text() == '{\n  "x": 1\n}\n'


@pytest.mark.slow
def test_a_killed_loader_worker_stops_the_run_with_the_cause(tmp_path):
    proc = start([sys.executable, "train_single_gpu.py", "--data-path", str(SAMPLE), "--output-dir", str(tmp_path),
                  "--img-size", "64", "--batch-size", "4", "--workers", "1", "--no-plots", "--epochs", "30",
                  *SMALL_MODEL])
    deadline = time.monotonic() + 120
    while not (tmp_path / "metrics.jsonl").exists():
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.1)
    for pid in child_pids(proc.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        time.sleep(0.02)
    ((code, out, err),) = finish([proc])
    assert code == 1, err
    assert "DataLoader worker (pid" in err and "is killed by signal: Killed" in err, err[-2000:]


@pytest.mark.slow
def test_a_failed_checkpoint_write_stops_the_run_and_the_next_run_goes_on(tmp_path):
    """A full disk, for real: a file-size limit under the checkpoint's size makes rank 0's inline
    write fail (EFBIG) while the small files go through. The run stops with the error's traceback
    (exit 1) and no last.pth; metrics.jsonl already holds epoch 1's line (it goes first). Given
    room again, `--resume auto` starts over (no checkpoint to go on from), removes the cut-off
    temporary file, and logs each epoch once."""
    code = ("import resource, runpy, signal, sys\n"
            "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
            "resource.setrlimit(resource.RLIMIT_FSIZE, (8 << 20, 8 << 20))\n"
            f"sys.argv = ['train_single_gpu.py', '--output-dir', {str(tmp_path)!r}, *{TRAIN!r}, *{SMALL_MODEL!r}]\n"
            "runpy.run_path('train_single_gpu.py', run_name='__main__')\n")
    result = run_cli([sys.executable, "-c", code], timeout=90)
    assert result.returncode == 1, result.stderr
    assert "Traceback" in result.stderr and "save_checkpoint(" in result.stderr, result.stderr[-3000:]
    assert not (tmp_path / "last.pth").exists() and list(tmp_path.glob(".*.pth.tmp")), list(tmp_path.iterdir())
    assert [r["epoch"] for r in metrics(tmp_path)] == [1]

    again = train_here(tmp_path, *SMALL_MODEL, "--epochs", "1", "--resume", "auto")
    assert again.returncode == 0, again.stderr[-3000:]
    assert not list(tmp_path.glob(".*.pth.tmp"))
    assert [r["epoch"] for r in metrics(tmp_path)] == [1]  # each epoch logged once


def test_checks_nccl_log_is_private_and_removed():
    """--check's NCCL log: a new file of its own in the temporary folder (not a name another
    user could have prepared), removed however the check ends."""
    first, second = check.nccl_log_file("nccl"), check.nccl_log_file("nccl")
    assert first != second and os.path.exists(first) and (os.stat(first).st_mode & 0o777) == 0o600
    check.remove_left_behind()
    assert not os.path.exists(first) and not os.path.exists(second)
    assert check.nccl_log_file("gloo") is None
