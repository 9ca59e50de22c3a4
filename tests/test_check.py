"""`--check` and the rendezvous that says who it waits for: real processes on loopback (gloo),
and the verdicts on machines this one is not, given as that machine's answers."""
from __future__ import annotations

import dataclasses
import os
import re
import socket
import sys
import time

import pytest
import torch
from conftest import (
    FAST,
    SAMPLE,
    call_main,
    free_port,
    kill_group,
    launcher_cmd,
    run_cli,
    start,
    user_error,
)

import train_multi_gpu_using_launch
import train_single_gpu
from cluster.check import StageTimeout, bounded, stderr_held
from cluster.check_rows import (
    FAIL,
    JOIN_FIX,
    OK,
    WARN,
    Facts,
    Figures,
    Row,
    address_rows,
    batch_for_share,
    bus_bandwidth,
    comm_share,
    device_rows,
    figure_rows,
    interface_rows,
    inventory_rows,
    link_class,
    local_rows,
    memory_rows,
    merged,
    nccl_transports,
    p2p_row,
    rendezvous_row,
    sum_row,
)
from utils import ProjectError


def by_hand(rank: int, world_size: int, port: int) -> dict[str, str]:
    """The environment a hand-written job script gives one process, without torchrun: its
    processes meet at rank 0's store (cluster/rendezvous.py's job_store), as srun's tasks do."""
    return {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}


def one_line_of_its_own(err: str, rank: int) -> str:
    """A rank's stderr: one line, its own: none of torch's C++ stack, no traceback."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"rank {rank} on {socket.gethostname()}: "), err
    return lines[0]


# ---- the check on real processes

CHECK = [*FAST, "--check", "--check-timeout", "8"]


def check_table(stdout: str) -> dict[str, list[str]]:
    """The table rank 0 printed: check -> its rows' result and finding."""
    rows: dict[str, list[str]] = {}
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("check ") and "result" in line)
    for line in lines[start + 1:]:
        if not line.strip():
            break
        if not line.startswith(" "):
            name, result_word, finding = re.match(r"(\S+(?: \S+)*?)\s{2,}(ok|warn|FAIL)\s+(.*)", line).groups()
            rows.setdefault(name, []).append(f"{result_word} {finding}")
    return rows


def assert_healthy(stdout: str, world_size: int) -> dict[str, list[str]]:
    assert "check: a job would run" in stdout
    table = check_table(stdout)
    assert all(row.startswith(("ok", "warn")) for rows in table.values() for row in rows), table
    assert {"output folder", "data", "device", "memory", "training step", "communication"} <= table.keys()
    assert re.match(r"ok \d+ ms for a batch of 8 on cpu", table["training step"][0])
    if world_size == 1:
        assert table["communication"] == ["ok one process: no gradient to all-reduce"]
        return table
    assert f"{world_size} process(es) on 1 node(s)" in table["inventory"][0]
    assert table["all-reduce"][0].startswith(f"ok gloo, {world_size} processes, sum checked")
    bandwidth = [float(x) for x in re.findall(r"([\d.]+) GB/s at", table["bus bandwidth"][0])]
    assert len(bandwidth) == 2 and all(b > 0 for b in bandwidth)
    assert re.search(rf"(at most|up to) \d+% of a step at {world_size} processes", table["communication"][0])
    # The step under DDP, timed on every rank at once, against the same step without it.
    under_ddp, alone, together, ratio, one = re.match(
        rf"ok a step under DDP (\d+) ms against (\d+) ms without it: {world_size} processes (\d+) img/s in all, "
        rf"([\d.]+)x one process's (\d+) \({world_size}x at best; each step timed beside the other processes'\)",
        table["scaling"][0]).groups()
    assert int(together) == pytest.approx(world_size * 8 * 1000 / int(under_ddp), abs=1)
    assert int(one) == pytest.approx(8 * 1000 / int(alone), abs=1)
    # The ratio of the unrounded figures: slow steps (a loaded machine) make the rounding count.
    t, o = int(together), int(one)
    assert (t - 0.5) / (o + 0.5) - 0.005 <= float(ratio) <= (t + 0.5) / (o - 0.5) + 0.005
    return table


@pytest.mark.slow
@pytest.mark.parametrize("launcher, world_size", [("single", 1), ("spawn", 2)])
def test_a_healthy_setup_passes_with_its_figures(tmp_path, launcher, world_size):
    result = run_cli(launcher_cmd(launcher, world_size) + ["--data-path", str(SAMPLE), "--output-dir",
                                                           str(tmp_path / "new" / "out"), *CHECK],
                     timeout=120, env={"OMP_NUM_THREADS": "1"})  # a hang's guard: each stage has --check-timeout
    assert result.returncode == 0, result.stdout + result.stderr
    assert_healthy(result.stdout, world_size)
    assert not (tmp_path / "new").exists()  # checked, and not left behind


@pytest.mark.slow
def test_two_torchrun_agents_pass_the_check_at_world_size_3(tmp_path):
    """Two agents joined by c10d, as on two nodes (2 processes and 1): the processes of each
    are started by torchrun, and the check's rendezvous is torchrun's store. Both agents on
    this machine meet on loopback, which the inventory's one host makes right."""
    endpoint = f"127.0.0.1:{free_port()}"
    agents = [start([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--nproc_per_node={n}",
                     "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", "--rdzv-id=check-test",
                     "train_multi_gpu_using_launch.py", "--data-path", str(SAMPLE), "--output-dir", str(tmp_path),
                     *CHECK], env={"OMP_NUM_THREADS": "1"}) for n in (2, 1)]
    try:
        outputs = [agent.communicate(timeout=60) for agent in agents]
    finally:
        for agent in agents:
            kill_group(agent)
    assert [agent.returncode for agent in agents] == [0, 0], outputs
    table = assert_healthy("".join(out for out, _ in outputs), 3)
    assert table["master address"][0].startswith("ok")


@pytest.mark.slow
def test_a_rank_that_cannot_reach_rank_0_says_so_itself():
    """Rank 0 missing: rank 1 tries its store until --check-timeout, then says so in one line
    (torch's client logs each failed try with a C++ stack, which the check holds back)."""
    started = time.monotonic()
    result = run_cli([sys.executable, "train_multi_gpu_using_launch.py", "--data-path", str(SAMPLE), *FAST,
                      "--check", "--check-timeout", "3"], timeout=60, env=by_hand(1, 2, free_port()))
    assert time.monotonic() - started < 60
    assert result.returncode == 1, result.stdout + result.stderr
    assert "check " not in result.stdout  # the table is rank 0's
    line = one_line_of_its_own(result.stderr, 1)
    assert re.search(r"rank 1 on \S+: rendezvous: rank 1 on \S+: no rendezvous at 127.0.0.1:\d+ within 3 s", line), line


@pytest.mark.slow
def test_a_rank_missing_ends_every_rank_within_a_minute_each_with_one_line(tmp_path):
    """Rank 2 of 3 never starts (issue 74): rank 0's table names it once --check-timeout has
    passed, and every rank ends non-zero within a minute with one line of its own; rank 1,
    whose rank 0 ends the rendezvous, without torch's C++ stack."""
    port = free_port()
    cmd = [sys.executable, "train_multi_gpu_using_launch.py", "--data-path", str(SAMPLE), "--output-dir",
           str(tmp_path), *FAST, "--check", "--check-timeout", "3"]
    started = time.monotonic()
    procs = [start(cmd, env=by_hand(rank, 3, port)) for rank in (0, 1)]
    try:
        (out0, err0), (out1, err1) = [proc.communicate(timeout=60) for proc in procs]
    finally:
        for proc in procs:
            kill_group(proc)
    assert time.monotonic() - started < 60
    assert [proc.returncode for proc in procs] == [1, 1], (err0, err1)
    [row] = check_table(out0)["rendezvous"]
    assert re.fullmatch(rf"FAIL 2 of 3 processes joined at 127.0.0.1:{port} within 3 s .*; missing: rank 2", row), row
    assert "check: a job would not run (rendezvous)" in out0
    assert "missing: rank 2" in one_line_of_its_own(err0, 0)
    assert "rank 0 ended the" in one_line_of_its_own(err1, 1)
    assert out1 == ""


@pytest.mark.slow
def test_a_gloo_interface_the_machine_lacks_ends_every_rank_at_once_with_one_line(tmp_path):
    """GLOO_SOCKET_IFNAME naming no interface of this machine, under torchrun (issue 74): gloo
    would raise in torch's rendezvous, a traceback in each process; each says which name is
    missing, in one line, before any rendezvous, and torchrun's summary carries that line."""
    missing = "nosuchif0"
    assert missing not in {name for _, name in socket.if_nameindex()}
    started = time.monotonic()
    result = run_cli(launcher_cmd("launch", 2) + ["--data-path", str(SAMPLE), "--output-dir", str(tmp_path), *CHECK],
                     timeout=60, env={"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": missing})
    assert time.monotonic() - started < 60
    assert result.returncode != 0
    own = [line for line in result.stderr.splitlines() if line.startswith(("error: ", "rank "))]
    assert len(own) == 2 and all("GLOO_SOCKET_IFNAME" in line and missing in line for line in own), result.stderr
    assert "Exception raised from" not in result.stderr  # torch's C++ stack
    assert 'train_multi_gpu_using_launch.py", line' not in result.stderr  # a traceback of ours (torchrun has its own)
    assert f"traceback : {own[0]}" in result.stderr


@pytest.mark.slow
def test_the_master_port_taken_is_named_with_the_fix(tmp_path):
    port = free_port()
    with socket.create_server(("127.0.0.1", port)):
        result = run_cli([sys.executable, "train_multi_gpu_using_launch.py", "--data-path", str(SAMPLE),
                          "--output-dir", str(tmp_path), *CHECK], timeout=60, env=by_hand(0, 1, port))
    assert result.returncode == 1, result.stdout + result.stderr
    row = check_table(result.stdout)["port"][0]
    assert row == f"FAIL cannot listen on 127.0.0.1:{port}: Address already in use (on {socket.gethostname()})"
    assert "-> another job holds the port: choose another MASTER_PORT" in result.stdout


@pytest.mark.parametrize("problem", ["data", "output"])
def test_a_wrong_data_path_or_output_folder_is_the_runs_own_error(tmp_path, capsys, problem):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    argv = ["--data-path", str(tmp_path / "missing") if problem == "data" else str(SAMPLE),
            "--output-dir", str(blocker / "out") if problem == "output" else str(tmp_path / "out"), *FAST]
    run_line = user_error(train_single_gpu.main, argv, capsys)
    assert user_error(train_single_gpu.main, argv + ["--check"], capsys) == run_line
    assert ("data" if problem == "data" else "cannot write to the output folder") in run_line


# ---- the verdicts, given the answers of machines this one is not

GiB = 2**30
HEALTHY = Facts(rank=0, host="node0", device="cuda:0", gpu="GPU-0a", gpus_visible=8, local_world_size=8, nodes=2,
                backend="nccl", nccl_available=True,
                versions={"torch": "2.5.1", "CUDA": "12.4", "NCCL": "2.21.5", "driver": "550.54"},
                socket_ifnames={"NCCL_SOCKET_IFNAME": "eth0"}, interfaces=("lo", "eth0", "ib0"), shm_free=64 * GiB,
                memory_available=500 * GiB,
                loader_bytes=GiB, cache_bytes=0, master="10.0.0.1", port=29500, master_resolves_to=("10.0.0.1",),
                hosts_store=True, port_problem=None)


def machine(**answers) -> Facts:
    return dataclasses.replace(HEALTHY, **answers)


def results(rows: list[Row]) -> dict[str, str]:
    return {row.check: row.result for row in rows}


def test_a_healthy_node_passes_every_local_check():
    assert results(local_rows(HEALTHY)) == {"device": OK, "master address": OK, "memory": OK}
    assert results(inventory_rows([HEALTHY, machine(rank=1, gpu="GPU-1b"), machine(rank=8, host="node1")])) == \
        {"inventory": OK}


def test_a_name_resolving_to_loopback_fails_with_several_nodes_only():
    loopback = machine(master="node0", master_resolves_to=("127.0.1.1",))
    row = next(r for r in local_rows(loopback) if r.check == "master address")
    assert row.result == FAIL and "127.0.1.1 (loopback)" in row.finding and "2 nodes" in row.finding
    assert "/etc/hosts" in row.fix
    assert results(address_rows(dataclasses.replace(loopback, nodes=1))) == {"master address": OK}
    assert results(address_rows(machine(master_resolves_to=()))) == {"master address": FAIL}


def test_an_nccl_socket_interface_the_machine_lacks_fails():
    assert interface_rows(HEALTHY) == []
    # NCCL's: prefixes; `=` exact names; `^` the names to leave out.
    for spec, fails in [("eth", False), ("ib", False), ("en", True), ("=eth", True), ("=eth0", False),
                        ("^lo,eth,ib", True), ("^lo", False), ("^=eth", False)]:
        assert bool(interface_rows(machine(socket_ifnames={"NCCL_SOCKET_IFNAME": spec}))) == fails, spec
    [row] = interface_rows(machine(socket_ifnames={"NCCL_SOCKET_IFNAME": "en"}))
    assert (row.check, row.result) == ("NCCL_SOCKET_IFNAME", FAIL)
    assert row.finding == "no interface of node0 matches NCCL_SOCKET_IFNAME=en (it has lo, eth0, ib0)"
    assert "ip addr" in row.fix
    assert interface_rows(machine(backend="gloo", device="cpu", socket_ifnames={"NCCL_SOCKET_IFNAME": "en"})) == []


def test_a_failed_rendezvous_is_named_in_one_line_without_torchs_file_and_line():
    missing = "2 of 3 processes joined at 10.0.0.1:29500 within 20 s; missing: rank 2"
    assert rendezvous_row(ProjectError(missing), HEALTHY) == Row("rendezvous", FAIL, missing, JOIN_FIX)
    store = rendezvous_row(torch.distributed.DistStoreError("wait timeout after 3000ms, keys: /default_pg/0//cpu//0/2"),
                           HEALTHY)
    assert (store.check, store.finding) == ("rendezvous", "torch's rendezvous at 10.0.0.1:29500: wait timeout after "
                                                          "3000ms, keys: /default_pg/0//cpu//0/2")
    gloo = rendezvous_row(RuntimeError("[enforce fail at /src/third_party/gloo/gloo/transport/tcp/device.cc:84] "
                                       "ifa != nullptr. Unable to find address for: ifb0"),
                          machine(backend="gloo", device="cpu"))
    assert (gloo.check, gloo.finding) == ("process group", "gloo could not start on node0: Unable to find address "
                                                           "for: ifb0")
    assert "GLOO_SOCKET_IFNAME" in gloo.fix


def test_what_torch_writes_on_stderr_while_the_ranks_meet_is_held_until_they_have(capfd):
    with stderr_held():
        os.write(2, b"[W socket.cpp:1] retrying\n")  # as torch's C++ writes it: to the file descriptor
        assert capfd.readouterr().err == ""
    assert capfd.readouterr().err == "[W socket.cpp:1] retrying\n"
    with pytest.raises(RuntimeError), stderr_held():
        os.write(2, b"Exception raised from recvBytes\nframe #0: c10::Error::Error\n")
        raise RuntimeError("Connection closed")
    assert capfd.readouterr().err == ""  # a failure is its rank's one line, written by give_up


def test_a_small_dev_shm_and_a_cache_that_does_not_fit_fail():
    small = machine(shm_free=GiB // 2, loader_bytes=GiB)
    row = next(r for r in memory_rows(small) if r.check == "/dev/shm")
    assert row.result == FAIL and "--shm-size" in row.fix
    big_cache = machine(cache_bytes=60 * GiB)  # above 80% of the 64 GiB of /dev/shm
    assert results(memory_rows(big_cache)) == {"--cache": FAIL}
    assert results(memory_rows(machine(cache_bytes=40 * GiB))) == {"memory": OK}


def test_more_processes_than_gpus_and_nccl_without_a_gpu_fail():
    assert results(device_rows(machine(gpus_visible=4))) == {"device": FAIL}
    assert results(device_rows(machine(nccl_available=False))) == {"backend": FAIL}
    assert results(device_rows(machine(device="cpu", gpu="", gpus_visible=0))) == {"backend": FAIL}


def test_versions_that_differ_across_nodes_are_named():
    other = machine(rank=8, host="node1", versions={**HEALTHY.versions, "torch": "2.4.0", "driver": "535.1"})
    rows = inventory_rows([HEALTHY, other])
    assert results(rows) == {"torch version": FAIL, "driver version": WARN}
    assert rows[0].finding == "differs: 2.5.1 on node0; 2.4.0 on node1"


def test_two_ranks_on_one_gpu_are_named():
    rows = inventory_rows([HEALTHY, machine(rank=1), machine(rank=2, gpu="GPU-2c"), machine(rank=3, host="node1")])
    assert results(rows) == {"GPU per process": FAIL}
    assert rows[0].finding.startswith("ranks 0, 1 on node0 share one GPU")


def test_a_hung_p2p_all_reduce_points_to_nccl_p2p_disable_and_its_cost():
    row = p2p_row(p2p_disabled=False, outcome="hung")
    assert row.result == FAIL and "NCCL_P2P_DISABLE=1" in row.fix and "slower" in row.fix
    assert p2p_row(p2p_disabled=True, outcome="ok").result == WARN
    assert p2p_row(p2p_disabled=False, outcome="ok") is None
    assert "not P2P" in p2p_row(p2p_disabled=True, outcome="hung").fix


def test_a_wrong_sum_fails():
    assert sum_row(6.0, 3, "gloo", 0.01).result == OK
    assert sum_row(5.0, 3, "gloo", 0.01).result == FAIL
    assert sum_row(float("nan"), 3, "nccl", 0.01).result == FAIL


def test_nccl_transports_are_read_from_its_info_lines():
    log = ("node0:1:2 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read\n"
           "node0:1:2 [0] NCCL INFO Channel 01/0 : 7[7] -> 8[0] [send] via NET/IB/0/GDRDMA\n"
           "node0:1:2 [0] NCCL INFO Channel 02/0 : 2[2] -> 3[3] via SHM/direct/direct\n")
    assert nccl_transports(log) == ["NET/IB", "P2P", "SHM"]
    assert nccl_transports("NCCL INFO Bootstrap : Using eth0:10.0.0.1<0>") == []


def test_bus_bandwidth_is_nccl_tests_definition():
    # nccl-tests: busbw = algbw * 2(n-1)/n; 1 GB in 0.1 s is 10 GB/s algbw, 17.5 GB/s busbw on 8 ranks
    assert bus_bandwidth(10**9, 0.1, 8) == pytest.approx(17.5e9)
    assert bus_bandwidth(10**9, 0.1, 2) == pytest.approx(10e9)


def test_the_communication_share_and_the_batch_that_brings_it_under_ten_percent():
    figures = Figures(world_size=4, device="cuda:0", batch=16, step_seconds=0.1, grad_bytes=85 * 2**20,
                      bucket_seconds=0.01, grad_seconds=0.05)
    assert comm_share(0.05, 0.1) == pytest.approx(1 / 3)
    better = batch_for_share(0.05, 0.1, 16)
    assert better == 73  # compute grows with the batch: 0.1 s * 73/16 > 9 x 0.05 s
    assert comm_share(0.05, 0.1 * better / 16) < 0.10 <= comm_share(0.05, 0.1 * (better - 1) / 16)
    rows = figure_rows(figures)
    assert results(rows) == {"training step": OK, "bus bandwidth": OK, "communication": WARN}
    assert "--batch-size 73 per process" in rows[-1].fix
    fast = dataclasses.replace(figures, grad_seconds=0.005)
    assert results(figure_rows(fast))["communication"] == OK


def test_each_figure_sits_in_the_range_of_one_kind_of_link():
    assert link_class(230e9).startswith("NVLink")
    assert link_class(20e9).startswith("PCIe 4/5")
    assert link_class(5e9).startswith("PCIe 3")
    assert link_class(1e9).startswith("10 Gb Ethernet")


def test_rows_that_several_ranks_give_are_shown_once():
    ok0, ok1 = Row("memory", OK, "64 GiB free"), Row("memory", OK, "63 GiB free")
    bad = Row("/dev/shm", FAIL, "too small on node1", "enlarge it")
    assert merged([[ok0], [ok1]]) == [ok0]
    assert merged([[ok0, bad], [ok1, bad]]) == [ok0, bad]
    failing_memory = Row("memory", WARN, "odd")
    assert merged([[ok0], [failing_memory]]) == [failing_memory]


def test_a_stage_that_hangs_becomes_a_timeout():
    started = time.monotonic()
    with pytest.raises(StageTimeout, match="the probe did not finish within 0.2s"):
        bounded("the probe", 0.2, lambda: time.sleep(5))
    assert time.monotonic() - started < 2
    assert bounded("a sum", 5, lambda: 1 + 1) == 2
    with pytest.raises(ZeroDivisionError):
        bounded("a failing stage", 5, lambda: 1 / 0)


def test_one_process_on_a_node_checks_the_way_to_the_first(monkeypatch, capsys, request):
    """What a user runs on a node that torchrun's agent waits for: the same command, in one
    process, with the first node's address, says whether that address answers from here."""
    # One math thread, as the suite's subprocesses have: the check times a step in this process,
    # and two threads on a busy 2-core machine can take many times longer than one.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    request.addfinalizer(lambda threads=torch.get_num_threads(): torch.set_num_threads(threads))
    torch.set_num_threads(1)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))  # nothing listens there
    with pytest.raises(SystemExit) as exit_info:
        call_main(train_multi_gpu_using_launch.main, ["--data-path", str(SAMPLE), *FAST, "--check"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 1, out
    assert re.search(r"port +FAIL +cannot reach 127.0.0.1:\d+: Connection refused", out), out
    assert "nc -zv 127.0.0.1" in out
