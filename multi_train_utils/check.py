"""`--check`: the user's own command line diagnoses the setup instead of training.

Stages, each under --check-timeout so that a hang becomes a verdict: what each process finds
alone (device, rendezvous address, shared memory, data, output folder), the rendezvous, the
inventory gathered to rank 0, a checked all-reduce, and the figures (bus bandwidth, one timed
training step, the share of a step gradient communication can cost). Rank 0 prints one table;
the exit code says whether a job would run (0) or not (1).

The verdicts are pure functions of facts: a machine this one is not (two nodes, another
driver, a small /dev/shm) is checked by giving them that machine's answers.
"""
from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import math
import os
import re
import shutil
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import torch
import torch.distributed as dist

from model import model_for
from multi_train_utils.config import Plan
from multi_train_utils.distributed_utils import (
    DistContext,
    Rendezvous,
    RendezvousIncomplete,
    broadcast_object,
    gather_objects,
    parse_device,
    port_unreachable,
    setup_single,
    teardown,
)
from multi_train_utils.loaders import cache_problem, memory_available
from multi_train_utils.run_folder import prepare_output_dir
from multi_train_utils.train_eval_utils import build_training, place_model, train_one_epoch
from my_dataset import cache_short_side, default_workers
from utils import stderr_line

OK, WARN, FAIL = "ok", "warn", "FAIL"
DDP_BUCKET_BYTES = 25 * 2**20  # DistributedDataParallel's bucket_cap_mb default
COMM_SHARE_GOAL = 0.10
LOADER_PREFETCH = 2  # batches each loader worker keeps ready (DataLoader's prefetch_factor)
T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Row:
    check: str
    result: str  # OK, WARN or FAIL
    finding: str
    fix: str = ""


class StageTimeout(Exception):
    pass


def bounded(stage: str, timeout_s: float, fn: Callable[[], T]) -> T:
    """fn() in a thread, given `timeout_s`: a hang becomes StageTimeout, not a wait. The thread
    is left behind (a stuck socket or collective cannot be cancelled); the check then exits."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # handed to the caller's thread
            box["error"] = e

    thread = threading.Thread(target=target, name=f"check {stage}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise StageTimeout(f"{stage} did not finish within {timeout_s:g}s (--check-timeout)")
    if "error" in box:
        raise box["error"]
    return box["value"]


# ---- what one process finds alone, before any rendezvous


@dataclasses.dataclass(frozen=True)
class Facts:
    """One process's machine, device and versions, and what its memory must hold."""

    rank: int
    host: str
    device: str  # "cuda:0", "cpu"
    gpu: str  # the GPU's UUID; "" on the CPU
    gpus_visible: int
    local_world_size: int
    nodes: int
    backend: str
    nccl_available: bool
    versions: dict[str, str]  # torch, CUDA, NCCL, driver
    socket_ifnames: dict[str, str]  # NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME as set
    shm_free: int
    memory_available: int
    loader_bytes: int  # /dev/shm the loader workers of this machine's processes hold in flight
    cache_bytes: int  # what --cache would keep in shared memory on this machine (0 without it)
    master: str  # the rendezvous host ("" for one process)
    port: int
    master_resolves_to: tuple[str, ...]
    hosts_store: bool  # this process listens at master:port for the others
    port_problem: str | None  # the store's host cannot listen on the port, or a process alone reach it


def gather_facts(plan: Plan, rdzv: Rendezvous | None) -> Facts:
    args = plan.args
    device = parse_device(args.device)
    local = rdzv.local_world_size if rdzv else 1
    world = rdzv.world_size if rdzv else 1
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    index = device.index if device.index is not None else (rdzv.local_rank if rdzv else 0)
    gpu = str(torch.cuda.get_device_properties(index).uuid) if device.type == "cuda" and index < gpus else ""
    backend = args.backend or ("nccl" if device.type == "cuda" else "gloo")
    master, port = rdzv.address() if rdzv else (os.environ.get("MASTER_ADDR", ""), int(os.environ.get("MASTER_PORT", 0)))
    shm = shutil.disk_usage("/dev/shm").free if os.path.isdir("/dev/shm") else 0
    return Facts(
        rank=rdzv.rank if rdzv else 0,
        host=socket.gethostname(),
        device=str(device) if device.type != "cuda" else f"cuda:{index}",
        gpu=gpu,
        gpus_visible=gpus,
        local_world_size=local,
        nodes=int(os.environ.get("GROUP_WORLD_SIZE") or os.environ.get("SLURM_NNODES") or math.ceil(world / local)),
        backend=backend,
        nccl_available=dist.is_nccl_available(),
        versions=versions(),
        socket_ifnames={k: v for k, v in sorted(os.environ.items()) if k.endswith("_SOCKET_IFNAME")},
        shm_free=shm,
        memory_available=memory_available() if sys.platform == "linux" else 0,  # /proc/meminfo's
        loader_bytes=loader_bytes(args, device, local),
        cache_bytes=cache_bytes(args, len(plan.samples)),
        master=master,
        port=port,
        master_resolves_to=resolve(master) if master else (),
        hosts_store=rdzv is not None and rdzv.hosts_store(),
        port_problem=port_problem(rdzv, master, port) if master and port else None,
    )


def versions() -> dict[str, str]:
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() and dist.is_nccl_available() else "-"
    driver = "-"
    if torch.cuda.is_available():
        try:
            driver = Path("/proc/driver/nvidia/version").read_text().split("Kernel Module")[1].split()[0]
        except (OSError, IndexError):
            driver = "unknown"
    return {"torch": torch.__version__, "CUDA": torch.version.cuda or "-", "NCCL": nccl, "driver": driver}


def loader_bytes(args: argparse.Namespace, device: torch.device, processes: int) -> int:
    """Batches in flight through /dev/shm: each worker of each process keeps LOADER_PREFETCH uint8 batches."""
    workers = default_workers(device, processes) if args.workers is None else args.workers
    return processes * workers * LOADER_PREFETCH * args.batch_size * 3 * args.img_size**2


def cache_bytes(args: argparse.Namespace, images: int) -> int:
    """--cache's pixels, about: the run reads every image's header for the exact figure; a
    4:3 picture is assumed here (most photos are)."""
    if not args.cache:
        return 0
    side = cache_short_side(vars(args))
    return int(images * 3 * side * side * 4 / 3)


def resolve(host: str) -> tuple[str, ...]:
    try:
        return tuple(sorted({info[4][0] for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)}))
    except socket.gaierror:
        return ()


def port_problem(rdzv: Rendezvous | None, host: str, port: int) -> str | None:
    """Whether this process can do its part at host:port now. The store's host must be able to
    listen there. A process alone (run on a node to test the way to the first) must reach it;
    in a job, reaching it is the rendezvous stage's, which waits for the first node to start."""
    if rdzv is None:
        problem = port_unreachable(host, port)
        return f"cannot reach {host}:{port}: {problem}" if problem else None
    if rdzv.hosts_store():
        try:
            with socket.create_server((host, port)):
                return None
        except OSError as e:
            return f"cannot listen on {host}:{port}: {os.strerror(e.errno) if e.errno else e}"
    return None


def local_rows(f: Facts) -> list[Row]:
    """The verdicts one process can give alone."""
    return [*device_rows(f), *address_rows(f), *memory_rows(f)]


def device_rows(f: Facts) -> list[Row]:
    rows = []
    if f.device.startswith("cuda") and f.gpus_visible < f.local_world_size:
        rows.append(Row("device", FAIL, f"{f.local_world_size} processes on {f.host}, {f.gpus_visible} GPU(s) visible",
                        f"start at most {f.gpus_visible} process(es) per node, or make more GPUs visible "
                        "(CUDA_VISIBLE_DEVICES)"))
    if f.backend == "nccl" and not f.nccl_available:
        rows.append(Row("backend", FAIL, "nccl asked for, but this PyTorch has no NCCL (a CPU or Windows build)",
                        "--backend gloo, or a CUDA build of PyTorch on Linux"))
    elif f.backend == "nccl" and not f.device.startswith("cuda"):
        rows.append(Row("backend", FAIL, f"nccl asked for on {f.device}: NCCL moves GPU memory only",
                        "--backend gloo on the CPU, or --device cuda"))
    if not rows:
        gpus = f", {f.gpus_visible} GPU(s) visible" if f.device.startswith("cuda") else ""
        rows.append(Row("device", OK, f"{f.device}, {f.backend}, {f.local_world_size} process(es) per node{gpus}"))
    return rows


def is_loopback(address: str) -> bool:
    return ipaddress.ip_address(address.split("%")[0]).is_loopback


def address_rows(f: Facts) -> list[Row]:
    if not f.master:
        return []
    if not f.master_resolves_to:
        return [Row("master address", FAIL, f"{f.master} does not resolve on {f.host}",
                    "set MASTER_ADDR (--master-addr, --rdzv-endpoint) to the first node's IP address, or a "
                    "name every node resolves")]
    rows = []
    if f.nodes > 1 and all(is_loopback(a) for a in f.master_resolves_to):
        rows.append(Row("master address", FAIL,
                        f"{f.master} resolves to {', '.join(f.master_resolves_to)} (loopback) on {f.host}, "
                        f"but the job has {f.nodes} nodes: the others cannot meet there",
                        "use the first node's address on the network (`hostname -I` on it), or fix the "
                        "name's line in /etc/hosts (Debian maps the host name to 127.0.1.1)"))
    if f.port_problem:
        rows.append(Row("port", FAIL, f"{f.port_problem} (on {f.host})",
                        "another job holds the port: choose another MASTER_PORT (--master-port)"
                        if f.hosts_store else
                        "start the first node first; check the address, and that a firewall lets the port "
                        f"through (`nc -zv {f.master} {f.port}` from this node)"))
    if not rows:
        rows.append(Row("master address", OK, f"{f.master} resolves to {', '.join(f.master_resolves_to)}"))
    return rows


def memory_rows(f: Facts) -> list[Row]:
    gib = 2**30
    rows = []
    if f.loader_bytes > f.shm_free:
        rows.append(Row("/dev/shm", FAIL, f"the loader workers on {f.host} hold about {f.loader_bytes / gib:.2f} GiB "
                        f"of batches in /dev/shm, which has {f.shm_free / gib:.2f} GiB free",
                        "enlarge /dev/shm (docker: --shm-size=8g), or lower --workers or --batch-size"))
    cache = cache_problem(f.cache_bytes, f.shm_free, f.memory_available)  # the run's own rule and words
    if cache:
        finding, _, fix = cache.partition(": ")
        rows.append(Row("--cache", FAIL, f"on {f.host}: {finding}, assuming 4:3 pictures",
                        f"{fix}; or enlarge /dev/shm"))
    if not rows:
        cache = f", --cache about {f.cache_bytes / gib:.2f} GiB" if f.cache_bytes else ""
        rows.append(Row("memory", OK, f"/dev/shm {f.shm_free / gib:.1f} GiB free, RAM {f.memory_available / gib:.1f} "
                        f"GiB available; loader batches about {f.loader_bytes / gib:.2f} GiB{cache}"))
    return rows


# ---- the inventory, gathered to rank 0


def inventory_rows(facts: list[Facts]) -> list[Row]:
    """Versions that differ across processes, and GPUs that two processes share."""
    rows = []
    for name in ("torch", "CUDA", "NCCL", "driver"):
        seen: dict[str, list[str]] = {}
        for f in facts:
            seen.setdefault(f.versions[name], []).append(f.host)
        if len(seen) > 1:
            where = "; ".join(f"{v} on {', '.join(sorted(set(hosts)))}" for v, hosts in seen.items())
            rows.append(Row(f"{name} version", FAIL if name in ("torch", "NCCL") else WARN, f"differs: {where}",
                            "install the same versions on every node (one container image, one environment)"))
    holders: dict[tuple[str, str], list[int]] = {}
    for f in facts:
        if f.gpu:
            holders.setdefault((f.host, f.gpu), []).append(f.rank)
    for (host, gpu), ranks in holders.items():
        if len(ranks) > 1:
            rows.append(Row("GPU per process", FAIL, f"ranks {', '.join(map(str, ranks))} on {host} share one GPU ({gpu})",
                            "give each process its own GPU: one process per GPU, and no CUDA_VISIBLE_DEVICES that "
                            "differs between the processes of a node"))
    ifnames = {tuple(sorted(f.socket_ifnames.items())) for f in facts}
    if len(ifnames) > 1:
        rows.append(Row("*_SOCKET_IFNAME", WARN, "set differently across processes: "
                        + "; ".join(f"rank {f.rank} on {f.host}: {f.socket_ifnames or 'unset'}" for f in facts),
                        "usually the same interface name everywhere; check `ip addr` on each node"))
    if not rows:
        hosts = sorted({f.host for f in facts})
        v = facts[0].versions
        ifname = ", ".join(f"{k}={val}" for k, val in facts[0].socket_ifnames.items()) or "no *_SOCKET_IFNAME set"
        rows.append(Row("inventory", OK, f"{len(facts)} process(es) on {len(hosts)} node(s) ({', '.join(hosts[:4])}"
                        f"{', ...' if len(hosts) > 4 else ''}): torch {v['torch']}, CUDA {v['CUDA']}, NCCL {v['NCCL']}, "
                        f"driver {v['driver']}; {ifname}"))
    return rows


def merged(rows_by_rank: list[list[Row]]) -> list[Row]:
    """Each rank's own verdicts in one list: every distinct warning and failure, and for a check
    that all ranks passed, the first rank's row alone (their figures differ a little)."""
    rows = [row for rows in rows_by_rank for row in rows]
    flagged = {row.check for row in rows if row.result != OK}
    out: list[Row] = []
    for row in rows:
        if row.result == OK:
            shown = row.check in flagged or any(r.check == row.check for r in out)
        else:
            shown = row in out
        if not shown:
            out.append(row)
    return out


# ---- collectives


def sum_row(got: float, world_size: int, backend: str, seconds: float) -> Row:
    """An all-reduce of rank + 1 from each rank must give 1 + 2 + ... + N."""
    expected = world_size * (world_size + 1) / 2
    if got != expected:
        return Row("all-reduce", FAIL, f"{backend} summed to {got:g}, not {expected:g}",
                   "a faulty transport: rerun with NCCL_DEBUG=INFO; try NCCL_P2P_DISABLE=1, then NCCL_IB_DISABLE=1")
    return Row("all-reduce", OK, f"{backend}, {world_size} processes, sum checked, {seconds * 1000:.0f} ms")


def p2p_row(p2p_disabled: bool, outcome: str) -> Row | None:
    """NCCL's GPU-to-GPU copies (P2P): a hang with them on, or the cost of running with them off.
    `outcome`: "ok", or "hung" when the all-reduce did not finish within the stage's timeout."""
    if outcome == "hung" and not p2p_disabled:
        return Row("NCCL P2P", FAIL, "the all-reduce hung with P2P (direct GPU-to-GPU copies) on",
                   "rerun the check with NCCL_P2P_DISABLE=1: if it passes, P2P is broken on this machine (often "
                   "PCIe ACS or the IOMMU; `nvidia-smi topo -m` shows the paths). The job then runs with "
                   "NCCL_P2P_DISABLE=1, copies going through host memory: expect a slower all-reduce")
    if outcome == "hung":
        return Row("NCCL P2P", FAIL, "the all-reduce hung even with NCCL_P2P_DISABLE=1",
                   "not P2P: rerun with NCCL_DEBUG=INFO and check NCCL_SOCKET_IFNAME and the firewall")
    if p2p_disabled:
        return Row("NCCL P2P", WARN, "NCCL_P2P_DISABLE=1: copies between GPUs go through host memory",
                   "a workaround with a cost (see the bus bandwidth below): drop it where P2P works")
    return None


TRANSPORT = re.compile(r" via (\S+)")


def nccl_transports(log: str) -> list[str]:
    """The transports NCCL chose, from its NCCL_DEBUG=INFO lines ("... via P2P/CUMEM/read",
    "... via NET/IB/0/GDRDMA"): the kind, and for the network which one."""
    found = set()
    for match in TRANSPORT.finditer(log):
        parts = match.group(1).split("/")
        found.add("/".join(parts[:2]) if parts[0] == "NET" else parts[0])
    return sorted(found)


# ---- figures


def bus_bandwidth(nbytes: int, seconds: float, world_size: int) -> float:
    """Bytes per second, as nccl-tests defines an all-reduce's bus bandwidth: the algorithm
    bandwidth (size / time) times 2(n-1)/n, what each link carries, comparable across n."""
    return nbytes / seconds * 2 * (world_size - 1) / world_size


# The bus bandwidth each kind of link can carry (its published speed, one direction): a figure
# at or above a floor needs at least that kind of link. docs/multi-node.md gives the sources.
LINKS = [
    (100e9, "NVLink/NVSwitch in a node (A100: 300 GB/s per direction, H100: 450 GB/s)"),
    (15e9, "PCIe 4/5 in a node (32/64 GB/s), or InfiniBand HDR/NDR between nodes (25/50 GB/s per port)"),
    (2e9, "PCIe 3, PCIe through host memory (P2P off), or 25-100 Gb Ethernet (3.1-12.5 GB/s)"),
    (0.0, "10 Gb Ethernet (1.25 GB/s) or slower, or processes sharing one CPU (gloo on loopback)"),
]


def link_class(busbw: float) -> str:
    return next(name for floor, name in LINKS if busbw >= floor)


def comm_share(comm_seconds: float, step_seconds: float) -> float:
    """The share of a step that the gradient all-reduce would take if nothing overlapped it:
    an upper bound, since DDP reduces each bucket while the backward pass goes on."""
    return comm_seconds / (comm_seconds + step_seconds)


def batch_for_share(comm_seconds: float, step_seconds: float, batch: int, goal: float = COMM_SHARE_GOAL) -> int:
    """The per-process batch at which the all-reduce falls under `goal` of a step, taking the
    step's compute as proportional to its batch (the gradient's size does not change)."""
    return math.floor(batch * comm_seconds * (1 - goal) / goal / step_seconds) + 1


@dataclasses.dataclass(frozen=True)
class Figures:
    world_size: int
    device: str
    batch: int
    step_seconds: float
    grad_bytes: int
    bucket_seconds: float | None = None  # all-reduce of DDP_BUCKET_BYTES; None with one process
    grad_seconds: float | None = None  # all-reduce of the model's gradient


def figure_rows(f: Figures) -> list[Row]:
    step = Row("training step", OK, f"{f.step_seconds * 1000:.0f} ms for a batch of {f.batch} on {f.device} "
               "(the model and options of this command line)")
    if f.bucket_seconds is None or f.grad_seconds is None:
        return [step, Row("communication", OK, "one process: no gradient to all-reduce")]
    bucket_bw = bus_bandwidth(DDP_BUCKET_BYTES, f.bucket_seconds, f.world_size)
    grad_bw = bus_bandwidth(f.grad_bytes, f.grad_seconds, f.world_size)
    share = comm_share(f.grad_seconds, f.step_seconds)
    bandwidth = Row("bus bandwidth", OK, f"{bucket_bw / 1e9:.2f} GB/s at DDP's 25 MiB bucket, {grad_bw / 1e9:.2f} GB/s "
                    f"at the model's {f.grad_bytes / 2**20:.0f} MiB gradient: the range of {link_class(grad_bw)}")
    if share < COMM_SHARE_GOAL:
        return [step, bandwidth, Row("communication", OK, f"at most {share:.0%} of a step at {f.world_size} processes "
                                     f"(the gradient's all-reduce, {f.grad_seconds * 1000:.0f} ms)")]
    better = batch_for_share(f.grad_seconds, f.step_seconds, f.batch)
    return [step, bandwidth, Row(
        "communication", WARN, f"up to {share:.0%} of a step at {f.world_size} processes (the gradient's all-reduce, "
        f"{f.grad_seconds * 1000:.0f} ms; DDP overlaps part of it with the backward pass)",
        f"under {COMM_SHARE_GOAL:.0%} from --batch-size {better} per process (or --accum-steps "
        f"{math.ceil(better / f.batch)}); a faster link otherwise (docs/multi-node.md)")]


def time_all_reduce(nbytes: int, ctx: DistContext, budget_s: float = 1.0) -> float:
    """Seconds for one all-reduce of `nbytes` of float32: the best of a few after a warm-up."""
    tensor = torch.ones(nbytes // 4, device=ctx.device)
    dist.all_reduce(tensor)
    best, spent = math.inf, 0.0
    for _ in range(5):
        synchronize(ctx.device)
        started = time.perf_counter()
        dist.all_reduce(tensor)
        synchronize(ctx.device)
        elapsed = time.perf_counter() - started
        best, spent = min(best, elapsed), spent + elapsed
        if broadcast_object(spent > budget_s, ctx):  # every rank leaves the loop together
            break
    return best


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_training_step(plan: Plan, device: torch.device) -> tuple[float, int]:
    """Seconds of one training step of the command line's model and batch on `device`, alone
    (no DDP: the compute that communication is weighed against); and the gradient's bytes."""
    args = plan.args
    classes = max(2, len({label for _, label in plan.samples}))
    torch.manual_seed(args.seed)
    placed = place_model(model_for(args, classes), args, device)
    ctx = DistContext.single(device)
    training = build_training(placed, args, ctx, batches_per_epoch=1)
    batch = [(torch.randint(0, 256, (args.batch_size, 3, args.img_size, args.img_size), dtype=torch.uint8),
              torch.randint(0, classes, (args.batch_size,)))]
    train_one_epoch(training, batch, ctx, 1, 1)  # warm-up: kernels chosen, memory allocated
    started = time.perf_counter()
    train_one_epoch(training, batch, ctx, 1, 1)  # ends with a host sync
    grad_bytes = sum(p.numel() * p.element_size() for p in placed.module.parameters() if p.requires_grad)
    return time.perf_counter() - started, grad_bytes


# ---- the check itself


def check(plan: Plan, rdzv: Rendezvous | None) -> int:
    """Diagnose the setup this command line would train on; rank 0 prints the table.
    Returns the exit code, the same on every rank: 0 when a job would run, 1 when not."""
    timeout = plan.args.check_timeout
    rank = rdzv.rank if rdzv else 0
    alone = [output_row(plan), data_row(plan)] if rank == 0 else []  # a bad folder: the run's own error
    try:
        facts = bounded("the local checks", timeout, lambda: gather_facts(plan, rdzv))
    except StageTimeout as e:
        give_up(rank, alone, Row("local checks", FAIL, str(e), "a name that takes long to resolve, or a hung file "
                                 "system (/dev/shm): see which with the same command in one process"))
    if rdzv is None:
        # The process a run would be: its device, its share of the cores.
        return report(alone + local_rows(facts) + figure_rows(step_figures(plan, setup_single(plan.args.device))))
    if facts.port_problem or not facts.master_resolves_to:  # no rendezvous can happen
        give_up(rank, alone + local_rows(facts), next(r for r in address_rows(facts) if r.result == FAIL))
    if transport_log := nccl_log_file(facts.backend):
        os.environ.update(NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT,P2P,NET", NCCL_DEBUG_FILE=transport_log)
    try:
        # The waiting is shown a few times within the timeout, and the missing named at its end.
        ctx = rdzv.join(plan.args.device, plan.args.backend, timeout, report_every_s=max(1.0, timeout / 4))
    except RendezvousIncomplete as e:
        give_up(rank, alone + local_rows(facts), Row(
            "rendezvous", FAIL, str(e), "start the missing processes; the same command with --check on each "
            "node shows what that node lacks (docs/troubleshooting.md)"))
    try:
        everyone = bounded("the inventory", timeout, lambda: gather_objects(facts, ctx))
        # Now the machines are known, not guessed from the launcher's node count: several
        # torchrun agents on one machine may meet on loopback.
        machines = len({f.host for f in everyone})
        inventory = merged([local_rows(dataclasses.replace(f, nodes=machines)) for f in everyone])
        inventory += inventory_rows(everyone)
        collective, hung = collective_rows(ctx, facts, timeout, transport_log)
        if hung:
            give_up(rank, alone + inventory + collective, collective[-1])
        figures = bounded("the figures", 4 * timeout, lambda: step_figures(plan, ctx))
    except StageTimeout as e:
        give_up(rank, alone, Row("collectives", FAIL, str(e), "a peer stopped answering: see its own line"))
    code = report(alone + inventory + collective + figure_rows(figures)) if ctx.is_main else 0
    code = broadcast_object(code, ctx)
    teardown()
    return code


def give_up(rank: int, rows: list[Row], reason: Row) -> NoReturn:
    """End a check that cannot go on: each rank's own line, rank 0's table, exit code 1. A
    timed-out stage may leave a thread stuck in a socket or a collective: no teardown."""
    stderr_line(f"rank {rank} on {socket.gethostname()}: {reason.check}: {reason.finding}")
    if rank == 0:
        report(rows + ([] if reason in rows else [reason]))
    sys.stdout.flush()
    os._exit(1)


def output_row(plan: Plan) -> Row:
    """The run's own check of the output folder (its error, its exit code). The folders made
    only for it are removed: a check leaves nothing behind."""
    near = Path(plan.args.output_dir or "runs")  # the default folder goes under runs/
    existed = {folder for folder in (near, *near.parents) if folder.exists()}
    path = prepare_output_dir(plan, DistContext.single())
    for folder in (path, *path.parents):
        if folder in existed or folder == Path("."):
            break
        folder.rmdir()
    return Row("output folder", OK, f"{path} is writable")


def data_row(plan: Plan) -> Row:
    classes = len({label for _, label in plan.samples})
    return Row("data", OK, f"{len(plan.samples)} images in {classes} classes under {plan.args.data_path} "
               "(listed, not decoded)")


def nccl_log_file(backend: str) -> str | None:
    """Where NCCL may write the INFO lines that name its transports: not when the user set NCCL_DEBUG."""
    if backend != "nccl" or "NCCL_DEBUG" in os.environ:
        return None
    return f"{tempfile.gettempdir()}/check-nccl-{os.getpid()}.log"


def collective_rows(ctx: DistContext, facts: Facts, timeout: float, transport_log: str | None) -> tuple[list[Row], bool]:
    """A checked all-reduce; on NCCL, what P2P did and the transports chosen. And whether it
    hung, the reason then being the last row."""
    started = time.perf_counter()
    try:
        total = bounded("the all-reduce", timeout, lambda: checked_sum(ctx))
    except StageTimeout as e:
        hung = p2p_row(os.environ.get("NCCL_P2P_DISABLE") == "1", "hung") if facts.backend == "nccl" else None
        return [hung or Row("all-reduce", FAIL, str(e), "a peer or a link stopped answering: see each rank's "
                            "line; NCCL_DEBUG=INFO shows where NCCL waits")], True
    rows = [sum_row(total, ctx.world_size, facts.backend, time.perf_counter() - started)]
    if facts.backend == "nccl":
        p2p = p2p_row(os.environ.get("NCCL_P2P_DISABLE") == "1", "ok")
        rows += [p2p] if p2p else []
        if transport_log and (found := nccl_transports(read_text(transport_log))):
            rows.append(Row("NCCL transport", OK, ", ".join(found)))
    return rows, False


def read_text(path: str) -> str:
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return ""


def checked_sum(ctx: DistContext) -> float:
    """Each rank gives rank + 1; every element must come back as the same sum."""
    tensor = torch.full((1024,), float(ctx.rank + 1), device=ctx.device)
    dist.all_reduce(tensor)
    return float(tensor[0]) if bool((tensor == tensor[0]).all()) else float("nan")


def step_figures(plan: Plan, ctx: DistContext) -> Figures:
    step_seconds, grad_bytes = time_training_step(plan, ctx.device)
    figures = Figures(ctx.world_size, str(ctx.device), plan.args.batch_size, step_seconds, grad_bytes)
    if ctx.world_size == 1:
        return figures
    return dataclasses.replace(figures, bucket_seconds=time_all_reduce(DDP_BUCKET_BYTES, ctx),
                               grad_seconds=time_all_reduce(grad_bytes, ctx))


def report(rows: list[Row]) -> int:
    """The table, and the exit code it amounts to."""
    width = max(len(r.check) for r in rows) + 2
    lines = ["", f"{'check':<{width}}{'result':<8}finding; what to do"]
    for r in rows:
        lines.append(f"{r.check:<{width}}{r.result:<8}{r.finding}")
        if r.fix:
            lines.append(f"{'':<{width + 8}}-> {r.fix}")
    failed = [r.check for r in rows if r.result == FAIL]
    lines += ["", f"check: a job would not run ({', '.join(failed)})" if failed else "check: a job would run"]
    print("\n".join(lines), flush=True)
    return 1 if failed else 0
