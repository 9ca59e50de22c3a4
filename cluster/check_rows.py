"""`--check`'s verdicts: each a pure function of facts (one process's machine, the inventory
of all, the figures measured), so a machine this one is not (two nodes, another driver, a small
/dev/shm) is checked by giving them that machine's answers; and the table they make."""
from __future__ import annotations

import dataclasses
import ipaddress
import math
import re

import torch.distributed as dist

from speed.image_cache import cache_problem
from utils import ProjectError

OK, WARN, FAIL = "ok", "warn", "FAIL"
DDP_BUCKET_BYTES = 25 * 2**20  # DistributedDataParallel's bucket_cap_mb default
COMM_SHARE_GOAL = 0.10


@dataclasses.dataclass(frozen=True)
class Row:
    check: str
    result: str  # OK, WARN or FAIL
    finding: str
    fix: str = ""


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
    interfaces: tuple[str, ...]  # the machine's network interfaces, by name
    shm_free: int
    memory_available: int
    loader_bytes: int  # /dev/shm the loader workers of this machine's processes hold in flight
    cache_bytes: int  # what --cache would keep in shared memory on this machine (0 without it)
    master: str  # the rendezvous host ("" for one process)
    port: int
    master_resolves_to: tuple[str, ...]
    hosts_store: bool  # this process listens at master:port for the others
    port_problem: str | None  # the store's host cannot listen on the port, or a process alone reach it


def local_rows(f: Facts) -> list[Row]:
    """The verdicts one process can give alone."""
    return [*device_rows(f), *address_rows(f), *interface_rows(f), *memory_rows(f)]


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


def address_rows(f: Facts) -> list[Row]:
    if not f.master:
        return []
    if not f.master_resolves_to:
        return [Row("master address", FAIL, f"{f.master} does not resolve on {f.host}",
                    "set MASTER_ADDR (--master-addr, --rdzv-endpoint) to the first node's IP address, or a "
                    "name every node resolves")]
    rows = []
    if f.nodes > 1 and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in f.master_resolves_to):
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


def interface_rows(f: Facts) -> list[Row]:
    """NCCL_SOCKET_IFNAME, when set under NCCL, must match an interface this machine has: NCCL
    fails at its first collective otherwise. It takes prefixes, `=` before exact names, `^`
    before those to leave out. (A GLOO_SOCKET_IFNAME naming one it lacks is the run's own error.)"""
    spec = f.socket_ifnames.get("NCCL_SOCKET_IFNAME") if f.backend == "nccl" else None
    if not spec:
        return []
    leave_out = spec.startswith("^")
    exact = spec.removeprefix("^").startswith("=")
    names = [n for n in spec.removeprefix("^").removeprefix("=").split(",") if n]
    matched = {i for i in f.interfaces if any(i == n if exact else i.startswith(n) for n in names)}
    if set(f.interfaces) - matched if leave_out else matched:
        return []
    return [Row("NCCL_SOCKET_IFNAME", FAIL, f"no interface of {f.host} matches NCCL_SOCKET_IFNAME={spec} (it has "
                f"{', '.join(f.interfaces)})", "name the interface on the network between the nodes (`ip addr` lists "
                "them), or unset it")]


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
    ddp_step_seconds: float | None = None  # the same step under DDP, every rank at once


def figure_rows(f: Figures) -> list[Row]:
    step = Row("training step", OK, f"{f.step_seconds * 1000:.0f} ms for a batch of {f.batch} on {f.device} "
               "(the model and options of this command line)")
    if f.bucket_seconds is None or f.grad_seconds is None:
        return [step, Row("communication", OK, "one process: no gradient to all-reduce")]
    bucket_bw = bus_bandwidth(DDP_BUCKET_BYTES, f.bucket_seconds, f.world_size)
    grad_bw = bus_bandwidth(f.grad_bytes, f.grad_seconds, f.world_size)
    share = comm_share(f.grad_seconds, f.step_seconds)
    scaling = [] if f.ddp_step_seconds is None else [scaling_row(f)]
    bandwidth = Row("bus bandwidth", OK, f"{bucket_bw / 1e9:.2f} GB/s at DDP's 25 MiB bucket, {grad_bw / 1e9:.2f} GB/s "
                    f"at the model's {f.grad_bytes / 2**20:.0f} MiB gradient: the range of {link_class(grad_bw)}")
    if share < COMM_SHARE_GOAL:
        return [step, bandwidth, Row("communication", OK, f"at most {share:.0%} of a step at {f.world_size} processes "
                                     f"(the gradient's all-reduce, {f.grad_seconds * 1000:.0f} ms)"), *scaling]
    better = batch_for_share(f.grad_seconds, f.step_seconds, f.batch)
    return [step, bandwidth, Row(
        "communication", WARN, f"up to {share:.0%} of a step at {f.world_size} processes (the gradient's all-reduce, "
        f"{f.grad_seconds * 1000:.0f} ms; DDP overlaps part of it with the backward pass)",
        f"under {COMM_SHARE_GOAL:.0%} from --batch-size {better} per process (or --accum-steps "
        f"{math.ceil(better / f.batch)}); a faster link otherwise (docs/multi-node.md)"), *scaling]


def scaling_row(f: Figures) -> Row:
    """What the processes make together under DDP against what one makes without the all-reduce,
    each step timed on every rank at once (processes that share CPUs each beside the others)."""
    alone, together = f.batch / f.step_seconds, f.world_size * f.batch / f.ddp_step_seconds
    return Row("scaling", OK, f"a step under DDP {f.ddp_step_seconds * 1000:.0f} ms against {f.step_seconds * 1000:.0f} ms "
               f"without it: {f.world_size} processes {together:.0f} img/s in all, {together / alone:.2f}x one process's "
               f"{alone:.0f} ({f.world_size}x at best; each step timed beside the other processes')")


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


JOIN_FIX = ("start the missing processes; the same command with --check on each node shows what that node lacks "
            "(docs/troubleshooting.md)")


def rendezvous_row(error: Exception, facts: Facts) -> Row:
    """A rendezvous that failed: the job store's own sentence, a wait at torch's that ran out (a
    process missing, or gone), or the backend that could not start here (gloo's interface, NCCL)."""
    if isinstance(error, ProjectError):
        return Row("rendezvous", FAIL, str(error), JOIN_FIX)
    why = (str(error).strip().splitlines() or [type(error).__name__])[-1]
    if isinstance(error, dist.DistError):
        return Row("rendezvous", FAIL, f"torch's rendezvous at {facts.master}:{facts.port}: {why}", JOIN_FIX)
    why = re.sub(r"^\[enforce fail at [^\]]*\] [^.]*\. ", "", why)  # gloo's file, line and condition
    return Row("process group", FAIL, f"{facts.backend} could not start on {facts.host}: {why}",
               "GLOO_SOCKET_IFNAME (NCCL_SOCKET_IFNAME) must name an interface that is up, with an address on the "
               "network between the nodes (`ip addr` lists them); NCCL_DEBUG=INFO tells more of NCCL")
