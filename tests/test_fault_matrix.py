"""The fault matrix: each fault a real run meets, on loopback with gloo, ends on every rank in
one paragraph that names the cause and the fix, a non-zero exit code, and no traceback; a run
whose training finished is not failed by a helper (docs/troubleshooting.md lists each message
beside the symptom a user would search for)."""
from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import FAST, SAMPLE, SMALL_MODEL, child_pids, kill_group, launcher_cmd, run_cli, start

from cluster import check
from outputs.plotter import Plotter
from processes.rendezvous import Rendezvous, find_free_port, meeting_store, not_local_problem, store_host

TRAIN = ["--data-path", str(SAMPLE), *FAST, "--epochs", "1"]


def srun_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    """One process of a job started from the environment, as srun starts one: no agent watches it."""
    return {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}


def start_ranks(out: Path, sizes: list[int], *extra: str, port: int | None = None) -> list:
    """Processes of one environment-started job, rank r believing the world size sizes[r]."""
    port = port or find_free_port()
    cmd = [sys.executable, "train_multi_gpu_using_launch.py", "--output-dir", str(out), *TRAIN, *extra]
    return [start(cmd, env=srun_env(rank, size, port)) for rank, size in enumerate(sizes)]


def finish(procs: list, timeout: float = 60) -> list[tuple[int, str, str]]:
    """(exit code, stdout, stderr) of each process, each given `timeout` seconds from now."""
    deadline, results = time.monotonic() + timeout, []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            results.append((proc.returncode, out, err))
    finally:
        for proc in procs:
            kill_group(proc)
    return results


def no_traceback(*texts: str) -> None:
    for text in texts:
        assert "Traceback" not in text, text


@pytest.mark.slow
@pytest.mark.parametrize("check", [False, True])
def test_a_socket_interface_that_does_not_exist_is_named_on_every_rank(tmp_path, check):
    """GLOO_SOCKET_IFNAME left over from another cluster: every rank names it and the interfaces
    that exist, before gloo fails deep inside its C++; --check puts it in its table."""
    cmd = launcher_cmd("spawn", 2) + ["--output-dir", str(tmp_path), *TRAIN, *(["--check"] if check else [])]
    result = run_cli(cmd, timeout=90, env={"GLOO_SOCKET_IFNAME": "nosuch0", "OMP_NUM_THREADS": "1"})
    no_traceback(result.stdout, result.stderr)
    lo = next(name for _, name in socket.if_nameindex() if name.startswith("lo"))
    for rank in (0, 1):
        assert f"rank {rank}" in result.stderr and "GLOO_SOCKET_IFNAME=nosuch0 names no network interface" in result.stderr
    assert lo in result.stderr
    if check:
        assert result.returncode == 1 and "check: a job would not run (socket interface)" in result.stdout
    else:
        assert result.returncode == 2


@pytest.mark.slow
@pytest.mark.parametrize("sizes, cause", [
    ([2, 3], "rank 0 was started for 2 processes, rank 1 on"),
    ([3, 2], "rank 0 was started for 3 processes, rank 1 on"),
])
def test_ranks_that_disagree_on_the_world_size_are_named_on_every_rank(tmp_path, sizes, cause):
    """Two nodes started with different --nproc_per_node, or an edited job script: found at the
    rendezvous (each rank says what it believes), within seconds, on every rank."""
    started = time.monotonic()
    results = finish(start_ranks(tmp_path, sizes))
    assert time.monotonic() - started < 45
    for code, out, err in results:
        assert code == 1, err
        no_traceback(out, err)
        assert "the processes disagree on the world size" in err and cause in err and "WORLD_SIZE" in err
    assert "rank 1 on" in results[1][2] and "rank 0 stopped the job at the rendezvous" in results[1][2]


@pytest.mark.slow
def test_two_processes_claiming_one_rank_are_named(tmp_path):
    port = find_free_port()
    procs = start_ranks(tmp_path, [3, 3], port=port)
    procs.append(start([sys.executable, "train_multi_gpu_using_launch.py", "--output-dir", str(tmp_path), *TRAIN],
                       env=srun_env(1, 3, port)))  # a second rank 1
    results = finish(procs)
    for code, out, err in results:
        assert code == 1 and "two processes claim rank 1" in err, err
        no_traceback(out, err)


@pytest.mark.slow
def test_a_port_held_by_another_program_is_named(tmp_path):
    """The rendezvous port answers, but not as a store (here a program that answers anything
    with an HTTP error): a rank says so instead of a C++ traceback or a wait without end."""
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            conn, _ = server.accept()
            with conn:
                conn.recv(64)
                conn.sendall(b"HTTP/1.0 400 Bad Request\r\n\r\n")

    threading.Thread(target=serve, daemon=True).start()
    cmd = [sys.executable, "train_multi_gpu_using_launch.py", "--output-dir", str(tmp_path), *TRAIN]
    result = run_cli(cmd, timeout=60, env=srun_env(1, 2, server.getsockname()[1]))
    assert result.returncode == 1, result.stderr
    no_traceback(result.stderr)
    # TCPStore's client retries a wrong answer until the greeting's bound (and logs C++ warnings meanwhile).
    assert "accepts connections, but gave" in result.stderr and "another program holds that port" in result.stderr


def test_a_master_addr_that_is_not_this_machines_is_named_before_rank_0_listens():
    """Rank 0 hosts the store at MASTER_ADDR; an address of another machine (here one from the
    documentation range 192.0.2.0/24) is found by binding to it here, which fails locally and
    sends nothing, before TCPStore would try to reach it and wait."""
    assert "is not an address of this machine" in not_local_problem("192.0.2.1", socket.gethostname())
    assert not_local_problem("127.0.0.1", socket.gethostname()) is None


def named_as_ended(err: str) -> set[int]:
    """The ranks a rank's paragraph names as ended ("rank 3, rank 5 ended (found by rank 2)")."""
    found = re.search(r"((?:rank \d+(?:, | and )?)+) ended \(found by rank \d+\)", err)
    return {int(n) for n in re.findall(r"\d+", found[1])} if found else set()


@pytest.mark.slow
def test_a_rank_killed_in_training_is_named_by_every_other_rank(tmp_path):
    """Six ranks started from the environment (as srun starts them; no agent watches), rank 3
    killed in training: every other rank ends within a minute, with exit code 1 and no
    traceback, naming rank 3 and no rank that is still there, and rank 0 says which checkpoint
    holds. Most of them wait in a collective that gloo has not yet seen break: they learn the
    cause from the store, from the first rank that found it."""
    procs = start_ranks(tmp_path, [6] * 6, *SMALL_MODEL, "--epochs", "30", "--batch-size", "2")
    deadline = time.monotonic() + 180
    while not (tmp_path / "metrics.jsonl").exists():
        assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, finish(procs)
        time.sleep(0.1)
    os.kill(procs[3].pid, signal.SIGKILL)
    killed = time.monotonic()
    results = finish(procs, timeout=60)
    assert time.monotonic() - killed < 60
    for rank, (code, out, err) in enumerate(results):
        if rank == 3:
            continue
        assert code == 1, (rank, code, err[-3000:])
        no_traceback(err)
        assert named_as_ended(err) == {3}, (rank, err[-3000:])
    assert f"{tmp_path / 'last.pth'} holds epoch" in results[0][2] and "--resume auto" in results[0][2]


@pytest.mark.slow
def test_a_check_that_rank_0_ends_points_the_others_at_its_table(tmp_path):
    """--check with rank 2 of 3 missing: rank 0 names it in its table; rank 1 says in one line
    that rank 0 ended the check, and rank 0's reason."""
    procs = start_ranks(tmp_path, [3, 3], "--check", "--check-timeout", "4")
    (code0, out0, err0), (code1, out1, err1) = finish(procs)
    assert code0 == code1 == 1
    no_traceback(out0, err0, out1, err1)
    assert "check: a job would not run (rendezvous)" in out0 and "missing: rank 2" in out0
    assert "--check" not in err0.split("rendezvous:", 1)[-1]  # no advice to run what is running
    # Rank 0's word, which reaches rank 1 on any machine (after "still trying" lines of its own
    # where it started more than a second before rank 0 listened).
    lines = [line for line in err1.strip().splitlines() if not line.endswith("still trying")]
    assert len(lines) == 1 and "rank 0 ended the check at the rendezvous: " in lines[0] and "missing: rank 2" in lines[0]


@pytest.mark.slow
def test_a_killed_loader_worker_stops_the_run_with_the_cause(tmp_path):
    proc = start([sys.executable, "train_single_gpu.py", "--data-path", str(SAMPLE), "--output-dir", str(tmp_path),
                  "--img-size", "64", "--batch-size", "4", "--workers", "1", "--no-plots", "--epochs", "30",
                  *SMALL_MODEL])
    deadline = time.monotonic() + 120
    while not (tmp_path / "metrics.jsonl").exists():
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.1)
    # The loader workers (no plotter: --no-plots), the second a moment after the first: its exit
    # reaches the run while it reads last.pth to name it, which once broke that reading.
    for pid in child_pids(proc.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        time.sleep(0.02)
    ((code, out, err),) = finish([proc])
    assert code == 1, err
    no_traceback(err)
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: a data-loader worker died (DataLoader worker (pid"), err
    assert "--workers" in last and "last.pth holds epoch" in last


@pytest.mark.slow
def test_a_failed_checkpoint_write_stops_the_run_and_says_what_holds(tmp_path):
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
    assert "No checkpoint was saved yet" in result.stderr
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


def listening_addresses(port: int) -> set[str]:
    """The local addresses something listens on at `port`, from /proc/net/tcp and tcp6."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, port_hex = local.split(":")
                if state == "0A" and int(port_hex, 16) == port:  # 0A: LISTEN
                    found.add(address)
    return found


def test_rank_0s_store_listens_on_its_address_alone_and_a_nat_address_is_a_warning(monkeypatch, capsys):
    """A job of one process started as srun starts one: with MASTER_ADDR on loopback, rank 0's
    store listens there only (127.0.0.1 in /proc/net/tcp, not every interface); with the
    machine's name, on every interface (the name may resolve here to 127.0.1.1, which no other
    machine reaches); with an address of no interface of this machine (a Kubernetes Service's,
    reached through NAT), it warns and listens on every interface instead of refusing."""
    for address, expected in (("127.0.0.1", {"0100007F"}), (socket.gethostname(), "every"), ("192.0.2.1", None)):
        port = find_free_port()
        monkeypatch.setenv("MASTER_ADDR", address)
        monkeypatch.setenv("MASTER_PORT", str(port))
        _, store = meeting_store(Rendezvous(0, 0, 1, 1), 10, 5)
        listening = listening_addresses(port)
        del store
        if expected == "every":
            assert listening and listening <= {"00000000", "0" * 32}, listening  # 0.0.0.0 or ::
        elif expected:
            assert listening == expected, listening
        else:
            assert listening and "0100007F" not in listening, listening  # 0.0.0.0 or ::
            err = capsys.readouterr().err
            assert "warning: MASTER_ADDR 192.0.2.1 is not an address of this machine" in err
            assert "through NAT" in err


def test_messages_name_the_process_that_hosts_the_store():
    assert store_host(Rendezvous(1, 1, 2, 2, ("127.0.0.1", 29500))) == "the spawn launcher"
    assert store_host(Rendezvous(1, 1, 2, 2)) == "rank 0"


def test_checks_nccl_log_is_private_and_removed():
    """--check's NCCL log: a new file of its own in the temporary folder (not a name another
    user could have prepared), removed however the check ends."""
    first, second = check.nccl_log_file("nccl"), check.nccl_log_file("nccl")
    assert first != second and os.path.exists(first) and (os.stat(first).st_mode & 0o777) == 0o600
    check.remove_left_behind()
    assert not os.path.exists(first) and not os.path.exists(second)
    assert check.nccl_log_file("gloo") is None
