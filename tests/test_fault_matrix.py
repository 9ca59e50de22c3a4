"""The fault matrix: what each fault a real run meets does to the job, on loopback with gloo,
started as users start it: a dead rank (rank 0 included) ends the job within a minute on every
launcher, and the launcher names it; a rank missing at the start is named within a minute; a
SIGTERM at any moment of the setup ends every process with 75; an IPv6 rendezvous works; a
run whose training finished is not failed by a helper (docs/troubleshooting.md lists each
message beside the symptom a user would search for)."""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
import uuid
from pathlib import Path

import pytest
from conftest import (FAST, FAST_DEFAULT_WORKERS, SAMPLE, SMALL_MODEL, child_pids, describe_processes, kill_group, launcher_cmd, run_cli,
                      processes_with_marker, start)

from cluster import check
from multi_train_utils.checkpoint import load_checkpoint, save_atomic
from multi_train_utils.distributed_utils import find_free_port
from outputs.plotter import Plotter

TRAIN = ["--data-path", str(SAMPLE), *FAST, "--epochs", "1"]
# The default loader workers: processes of their own, which must end with the job.
TRAIN_DEFAULT_WORKERS = ["--data-path", str(SAMPLE), *FAST_DEFAULT_WORKERS, "--epochs", "1"]
EXIT_PREEMPTED = 75


def env_ranks(rank: int, world_size: int, port: int, address: str = "127.0.0.1") -> dict[str, str]:
    """One process of a job started from the environment, as srun (or a user) starts one: no
    agent watches it."""
    return {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank), "MASTER_ADDR": address,
            "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}


def start_ranks(out: Path, ranks: list[int], world_size: int, *extra: str, address: str = "127.0.0.1",
                marker: str = "", train: list[str] = TRAIN) -> list:
    port = find_free_port(address)
    cmd = [sys.executable, "train_multi_gpu_using_launch.py", "--output-dir", str(out), *train, *extra]
    return [start(cmd, env={**env_ranks(rank, world_size, port, address), "TEST_JOB_MARKER": marker})
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
def test_a_rank_missing_at_the_start_is_named_and_a_check_says_so_on_every_rank(tmp_path):
    """Rank 2 of 3 never starts (srun, or a job started by hand): rank 0 names it once the join's
    time has passed (a minute, or --dist-timeout if shorter), not silence for --dist-timeout's
    30 minutes, and the other rank ends too. --check, the same within --check-timeout: rank 0's
    table names it; rank 1 says that rank 0 ended the check."""
    procs = start_ranks(tmp_path / "run", [0, 1], 3, "--dist-timeout", "5")
    (code0, _, err0), (code1, _, err1) = finish(procs)
    assert code0 == 1 and "2 of 3 processes joined" in err0 and "missing: rank 2" in err0, err0[-2000:]
    assert code1 != 0
    no_traceback(err0)
    procs = start_ranks(tmp_path / "check", [0, 1], 3, "--check", "--check-timeout", "4")
    (code0, out0, err0), (code1, out1, err1) = finish(procs)
    assert code0 == code1 == 1
    no_traceback(out0, err0, out1, err1)
    assert "check: a job would not run (rendezvous)" in out0 and "missing: rank 2" in out0
    assert "rank 0 ended the check at the rendezvous" in err1


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
    port = find_free_port()
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
def test_a_sigterm_during_setup_ends_every_process_with_75(launcher, phase, tmp_path):
    """SIGTERM to every process of the job (as slurmstepd and torchrun's killpg send it) as a
    phase of the setup starts: the rendezvous, listing and checking the images, the --cache
    fill. Every training process exits 75 at once (the spawn launcher too; torchrun decides its
    own code), before the first step: a long setup must not outlast the scheduler's grace."""
    nproc = 1 if launcher == "single" else 2
    proc = start(launcher_cmd(launcher, nproc) + ["--output-dir", str(tmp_path), *TRAIN, "--cache"])
    try:
        for line in proc.stdout:
            if phase in line:
                os.killpg(proc.pid, signal.SIGTERM)
                break
        out, err = proc.communicate(timeout=60)
    finally:
        kill_group(proc)
    assert "epoch 1/1" not in out
    stopped = err.count("stopped: SIGTERM before training")
    assert stopped == nproc, err[-3000:]
    if launcher != "launch":  # torchrun, signalled itself, raises torch's SignalException: its own traceback, exit 1
        assert proc.returncode == EXIT_PREEMPTED and "Traceback" not in err, (proc.returncode, err[-3000:])


@pytest.mark.slow
def test_a_sigterm_to_the_spawn_launcher_as_its_processes_start_ends_them_with_75(tmp_path):
    """The launcher alone signalled while its processes still start, before their own handler
    exists: they ignore it until then, and the launcher passes it on until they have ended."""
    proc = start(launcher_cmd("spawn", 2) + ["--output-dir", str(tmp_path), *TRAIN])
    try:
        workers_of(proc)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        kill_group(proc)
    assert proc.returncode == EXIT_PREEMPTED, (proc.returncode, err[-3000:])


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
def test_a_failed_checkpoint_write_stops_the_run_and_says_why(tmp_path):
    """A full disk, for real: a file-size limit under the checkpoint's size makes rank 0's write
    fail (EFBIG) while the small files go through."""
    code = ("import resource, runpy, signal, sys\n"
            "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
            "resource.setrlimit(resource.RLIMIT_FSIZE, (8 << 20, 8 << 20))\n"
            f"sys.argv = ['train_single_gpu.py', '--output-dir', {str(tmp_path)!r}, *{TRAIN!r}]\n"
            "runpy.run_path('train_single_gpu.py', run_name='__main__')\n")
    result = run_cli([sys.executable, "-c", code], timeout=90)
    assert result.returncode == 1, result.stderr
    no_traceback(result.stderr)
    assert f"rank 0 could not write epoch 1's checkpoint and metrics to {tmp_path}" in result.stderr
    assert not (tmp_path / "last.pth").exists()


def test_a_dead_plotter_costs_its_pictures_not_the_run(tmp_path, capsys):
    """A drawing process killed (as an out-of-memory killer might choose it): the run is told
    which pictures may be missing and how to draw them, and ends without an error."""
    with Plotter(tmp_path) as plotter:
        victim = plotter._children[0][0]
        os.kill(victim.pid, signal.SIGKILL)
        victim.join()
        plotter.draw_data()
        plotter.draw_results()
    err = capsys.readouterr().err
    assert "warning: a plotting process was killed by signal 9" in err
    assert "the training curves may be missing" in err and f"python plots.py {tmp_path}" in err


def test_checks_nccl_log_is_private_and_removed():
    """--check's NCCL log: a new file of its own in the temporary folder (not a name another
    user could have prepared), removed however the check ends."""
    first, second = check.nccl_log_file("nccl"), check.nccl_log_file("nccl")
    assert first != second and os.path.exists(first) and (os.stat(first).st_mode & 0o777) == 0o600
    check.remove_left_behind()
    assert not os.path.exists(first) and not os.path.exists(second)
    assert check.nccl_log_file("gloo") is None
