"""Process setup and teardown, and the few collectives the training loop needs.

Distributed state is a value: `setup_*` returns a frozen `DistContext` that the rest of the
code receives as an argument. Every reduction here is plain arithmetic when no process group
exists, so the single-process path runs the same code as DDP.
"""
from __future__ import annotations

import ctypes
import dataclasses
import datetime
import os
import signal
import socket
import sys
import time
import urllib.parse
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from utils import ProjectError, UserError, cpu_count, stderr_line

# Seconds the other processes of a job get to exit by themselves once one has failed, before
# SIGTERM, and again before SIGKILL (mp.spawn's own default waits 30 s at each stage).
STOP_GRACE_SECONDS = 5
# A job waiting at the rendezvous says so after this many seconds, and again at this interval.
JOIN_REPORT_SECONDS = 30
FIRST_JOIN_REPORT_SECONDS = 5


@dataclasses.dataclass(frozen=True)
class DistContext:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    distributed: bool  # a process group exists (also true for a torchrun job of one process)

    @classmethod
    def single(cls, device: torch.device = torch.device("cpu")) -> DistContext:
        """One process, no process group."""
        return cls(0, 0, 1, 1, device, distributed=False)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def print0(self, *args: Any, **kwargs: Any) -> None:
        if self.is_main:
            print(*args, **kwargs, flush=True)


def parse_device(spec: str | None) -> torch.device:
    """`--device` as written: `None` means CUDA when present, else the CPU; a bare number N
    means GPU N, as in the original scripts."""
    if spec is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if "," in spec:
        raise UserError(f"--device {spec!r} names several devices: give one (cuda or cpu), and choose the GPUs "
                        f"with CUDA_VISIBLE_DEVICES={spec}")
    try:
        return torch.device(f"cuda:{spec}" if spec.isdigit() else spec)
    except RuntimeError as e:
        raise UserError(f"--device {spec!r} is not a device: {e}") from None


def resolve_device(spec: str | None, local_rank: int, local_world_size: int = 1,
                   distributed: bool = False) -> torch.device:
    """The device of this process: `--device`'s type, and on CUDA the GPU of its local rank.
    An explicit GPU index is for one process alone; in a job it must agree with that rule."""
    device = parse_device(spec)
    if device.type != "cuda":
        return device
    available = torch.cuda.device_count()
    if available == 0:
        raise UserError(f"--device {spec} asked for CUDA, but no GPU is visible")
    if distributed and device.index is not None and (local_world_size > 1 or device.index != local_rank):
        raise UserError(
            f"--device {spec} names GPU {device.index}, but in a job each process takes the GPU of its local rank "
            f"({local_world_size} process(es) on this machine): pass --device cuda, and choose the GPUs with "
            "CUDA_VISIBLE_DEVICES"
        )
    index = local_rank if device.index is None else device.index
    if index >= available:
        raise UserError(
            f"this process wants GPU {index}, but only {available} GPU(s) are visible: "
            f"start at most {available} process(es) per machine"
        )
    return torch.device("cuda", index)


def _configure_threads(device: torch.device, local_world_size: int) -> None:
    """Give each CPU process its share of the cores.

    N processes that each start as many math threads as the machine has cores slow each
    other down several-fold. mp.spawn exports nothing, and torchrun's OMP_NUM_THREADS=1 would
    leave all but N cores idle, so we divide the cores here. The user's OMP_NUM_THREADS wins.
    """
    if device.type != "cpu" or ("OMP_NUM_THREADS" in os.environ and not _torchrun_set_threads(local_world_size)):
        return
    threads = max(1, cpu_count() // local_world_size)
    torch.set_num_threads(threads)


def _torchrun_set_threads(local_world_size: int) -> bool:
    """Whether OMP_NUM_THREADS=1 is torchrun's default rather than the user's choice.

    torchrun sets it inside its own process, only when it was unset and more than one process
    runs per machine; the environment torchrun itself started with (its /proc entry) then lacks
    it. Where that cannot be read (no /proc), a 1 under such a torchrun counts as the default.
    """
    if os.environ.get("OMP_NUM_THREADS") != "1" or "TORCHELASTIC_RUN_ID" not in os.environ or local_world_size < 2:
        return False
    launcher = _launcher_environ()
    return launcher is None or "OMP_NUM_THREADS" not in launcher


def _launcher_environ() -> dict[str, str] | None:
    """The environment this process's parent (torchrun's agent) was started with, if readable."""
    try:
        with open(f"/proc/{os.getppid()}/environ", "rb") as f:
            entries = f.read().split(b"\0")
    except OSError:
        return None
    return dict(e.decode(errors="replace").partition("=")[::2] for e in entries if e)


def setup_single(device_spec: str | None) -> DistContext:
    device = resolve_device(device_spec, 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    _configure_threads(device, 1)
    return DistContext.single(device)


@dataclasses.dataclass(frozen=True)
class Rendezvous:
    """Who this process is in its job and where the job meets, before it has met."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    store_address: tuple[str, int] | None = None  # the spawn launcher's store; None: MASTER_ADDR/MASTER_PORT

    def join(self, device_spec: str | None, backend: str | None, timeout_s: float,
             report_every_s: float = JOIN_REPORT_SECONDS) -> DistContext:
        return setup_process_group(self.rank, self.local_rank, self.world_size, self.local_world_size, device_spec,
                                   backend, timeout_s, self.store_address, report_every_s)

    def address(self) -> tuple[str, int]:
        return self.store_address or master_address()

    def hosts_store(self) -> bool:
        """This process listens for the others (rank 0 of a job started without torchrun's agent)."""
        return self.store_address is None and self.rank == 0 and not agent_hosts_store()


class RendezvousIncomplete(ProjectError):
    """Some processes of the job never joined (or never reached the store) in time: exit code 1."""


def setup_process_group(
    rank: int,
    local_rank: int,
    world_size: int,
    local_world_size: int,
    device_spec: str | None,
    backend: str | None,
    timeout_s: float,
    store_address: tuple[str, int] | None = None,
    report_every_s: float = JOIN_REPORT_SECONDS,
) -> DistContext:
    """Join the process group of the given ranks: through the store at `store_address`
    (hosted by the spawn launcher), else through MASTER_ADDR/MASTER_PORT (torchrun, SLURM).
    `timeout_s` bounds the rendezvous and every collective: a missing, dead or stuck peer
    becomes an error, not a hang. While processes are missing, rank 0 says which, every
    `report_every_s` seconds."""
    device = resolve_device(device_spec, local_rank, local_world_size, distributed=True)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    _configure_threads(device, local_world_size)
    timeout = datetime.timedelta(seconds=timeout_s)
    if store_address is not None:
        host, port = store_address
        store = connect_store(host, port, rank, timeout_s, report_every_s)
    else:
        host, port, store = _env_store(rank, world_size, timeout_s, report_every_s)
    wait_for_ranks(store, rank, world_size, local_world_size, f"{host}:{port}", timeout_s, report_every_s)
    dist.init_process_group(
        backend=backend,
        rank=rank,
        world_size=world_size,
        timeout=timeout,
        store=store,
        # Binding the group to this rank's GPU lets NCCL connect eagerly and avoids
        # "devices used by this process are currently unknown" warnings in barrier().
        device_id=device if backend == "nccl" else None,
    )
    ctx = DistContext(rank, local_rank, world_size, local_world_size, device, distributed=True)
    ctx.print0(
        f"process group: backend={backend}, world_size={world_size}, "
        f"rendezvous={host}:{port}, "
        f"threads per process={torch.get_num_threads()}"
    )
    return ctx


def _env_store(rank: int, world_size: int, timeout_s: float, report_every_s: float) -> tuple[str, int, dist.Store]:
    """The store that init_method="env://" would open, namespaced by torchrun's restart count.

    torchrun keeps one store for the whole job. After a worker dies and the group restarts,
    the new processes would otherwise find the addresses that the failed group published
    under the same keys, and hang or fail to connect to processes that no longer exist.
    """
    host, port = master_address()
    # Under torchrun the agent hosts the store and every worker is a client; otherwise rank 0 hosts it.
    if rank == 0 and not agent_hosts_store():
        # Not waiting for the others here: wait_for_ranks does, and says who is missing.
        try:
            store = dist.TCPStore(host, port, world_size, is_master=True, wait_for_workers=False,
                                  timeout=datetime.timedelta(seconds=timeout_s))
        except dist.DistNetworkError as e:
            raise UserError(f"cannot listen on {host}:{port} ({str(e).rsplit('message: ', 1)[-1]}): is MASTER_PORT "
                            "used by another job?") from None
    else:
        store = connect_store(host, port, rank, timeout_s, report_every_s)
    return host, port, dist.PrefixStore(f"restart{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def master_address() -> tuple[str, int]:
    """MASTER_ADDR and MASTER_PORT, as torchrun or the job script set them."""
    try:
        return os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    except (KeyError, ValueError):
        raise UserError("MASTER_ADDR and MASTER_PORT must be set to the rendezvous address") from None


def agent_hosts_store() -> bool:
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def connect_store(host: str, port: int, rank: int, timeout_s: float, report_every_s: float) -> dist.Store:
    """A client of the store at host:port, once the port answers. A process that cannot reach it
    says so at intervals, on its own line (rank 0, which prints the job's lines, may be the
    one missing), and names the address once `timeout_s` has passed."""
    started = time.monotonic()
    next_report = started + min(FIRST_JOIN_REPORT_SECONDS, report_every_s)
    while (problem := port_unreachable(host, port)) is not None:
        waited = time.monotonic() - started
        where = f"rank {rank} on {socket.gethostname()} cannot reach the rendezvous at {host}:{port} ({problem})"
        if waited >= timeout_s:
            raise RendezvousIncomplete(f"{where} after {timeout_s:g}s: is rank 0 (or torchrun on the first node) "
                                       "started, the address right and the port open? The same command with "
                                       "--check tells")
        if time.monotonic() >= next_report:
            stderr_line(f"{where} after {waited:.0f}s; still trying")
            next_report += report_every_s
        time.sleep(0.2)
    return dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))


def port_unreachable(host: str, port: int, timeout_s: float = 1.0) -> str | None:
    """Why a TCP connection to host:port fails (refused, timed out, no such host), or None."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except socket.gaierror as e:
        return f"the name does not resolve: {e.strerror}"
    except OSError as e:
        return e.strerror or type(e).__name__


def wait_for_ranks(store: dist.Store, rank: int, world_size: int, local_world_size: int, where: str,
                   timeout_s: float, report_every_s: float) -> None:
    """Mark this process as arrived; on rank 0, wait until all have, saying who is missing at
    intervals and naming them once `timeout_s` has passed. init_process_group would wait in
    silence, and time out without a name."""
    store.set(f"joined/{rank}", socket.gethostname())
    joined = store.add("joined", 1)
    if rank != 0:
        return
    started = time.monotonic()
    next_report = started + min(FIRST_JOIN_REPORT_SECONDS, report_every_s)
    while joined < world_size:
        waited = time.monotonic() - started
        if waited >= timeout_s:
            raise RendezvousIncomplete(f"{waiting_line(store, world_size, local_world_size, where)} after "
                                       f"{timeout_s:g}s: run the same command with --check (on each node) to find why")
        if time.monotonic() >= next_report:
            print(f"waiting: {waiting_line(store, world_size, local_world_size, where)} ({waited:.0f}s so far; "
                  "the same command with --check diagnoses the setup)", flush=True)
            next_report += report_every_s
        time.sleep(0.1)
        joined = store.add("joined", 0)


def waiting_line(store: dist.Store, world_size: int, local_world_size: int, where: str) -> str:
    """"1 of 2 processes joined at HOST:PORT; missing: rank 1", the missing read from the store."""
    missing = [r for r in range(world_size) if not store.check([f"joined/{r}"])]
    return (f"{world_size - len(missing)} of {world_size} processes joined at {where}; missing: "
            f"{missing_ranks(missing, world_size, local_world_size)}")


def missing_ranks(missing: list[int], world_size: int, local_world_size: int, most: int = 8) -> str:
    """"rank 3 (node 1)": the node where the usual layout (consecutive ranks per node, as torchrun
    and srun place them) would put it, when there are several nodes."""
    several_nodes = local_world_size < world_size
    names = [f"rank {r}" + (f" (node {r // local_world_size})" if several_nodes else "") for r in missing[:most]]
    more = f" and {len(missing) - most} more" if len(missing) > most else ""
    return ", ".join(names) + more


def env_ranks(local_rank_arg: int | None = None) -> tuple[int, int, int, int] | None:
    """(rank, local_rank, world_size, local_world_size) from torchrun or SLURM, else None.

    torchrun and `torch.distributed.launch --use_env` export RANK/LOCAL_RANK/WORLD_SIZE; the
    legacy launcher without --use_env passes --local-rank instead of LOCAL_RANK. Under `srun`
    one task is one process, described by SLURM_PROCID/SLURM_LOCALID/SLURM_NTASKS; the rendezvous
    address must then come from MASTER_ADDR/MASTER_PORT (see the sbatch script in docs/multi-node.md).
    """
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        world_size = int(env["WORLD_SIZE"])
        local_rank = int(env.get("LOCAL_RANK", local_rank_arg if local_rank_arg is not None else 0))
        local_world_size = int(env.get("LOCAL_WORLD_SIZE", world_size))
        return int(env["RANK"]), local_rank, world_size, local_world_size
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in env]
        if missing:
            raise UserError(
                f"running under SLURM but {' and '.join(missing)} is not set: export the first "
                "node's address and a free port in the sbatch script (see docs/multi-node.md, SLURM)"
            )
        world_size = int(env["SLURM_NTASKS"])
        nodes = int(env.get("SLURM_NNODES", "1"))
        local_world_size = int(env.get("SLURM_NTASKS_PER_NODE", "0").split("(")[0] or 0) or max(
            1, world_size // nodes
        )
        return int(env["SLURM_PROCID"]), int(env.get("SLURM_LOCALID", "0")), world_size, local_world_size
    return None


def teardown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def parse_dist_url(url: str) -> tuple[str, int] | None:
    """`--dist-url` (the original scripts' init_method): None for env://, else (host, port)."""
    if url == "env://":
        return None
    parts = urllib.parse.urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme != "tcp" or not parts.hostname or not port:
        raise UserError(f"--dist-url {url!r} is not env:// or tcp://HOST:PORT")
    return parts.hostname, port


def find_free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def host_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """The rendezvous store for processes this one starts, listening on host:port only.

    Port 0 asks the OS for a free port while binding it, so two jobs started at the same
    moment cannot pick the same one (as "find a free port, then let rank 0 bind it" can).
    The socket is ours because TCPStore itself would listen on every interface.
    """
    try:
        sock = socket.create_server((host, port), backlog=128)
    except OSError as e:
        raise UserError(f"cannot listen on {host}:{port} ({e.strerror}): is MASTER_PORT used by another job?") from None
    return dist.TCPStore(
        host, sock.getsockname()[1], None, is_master=True, timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False, master_listen_fd=sock.detach(),
    )


class TerminationRequest:
    """SIGTERM, which SLURM, Kubernetes and most schedulers send some time before they kill a
    job, turned into a flag: the training loop reads it at its next check, and the ranks then
    stop together. In effect inside the `with` block (the main thread's)."""

    def __init__(self) -> None:
        self.received = False

    def __enter__(self) -> TerminationRequest:
        self._previous = signal.signal(signal.SIGTERM, self._note)
        return self

    def __exit__(self, *exc: object) -> None:
        signal.signal(signal.SIGTERM, self._previous)

    def _note(self, signum: int, frame: object) -> None:
        self.received = True

    def __call__(self) -> bool:
        return self.received


def keep_gloo_on_loopback(host: str) -> str | None:
    """Point gloo at the loopback interface when the rendezvous is on loopback, so that the
    processes of a one-machine job connect over it and nothing listens beyond the machine.
    Returns the interface it chose, or None when it left the environment alone (set already,
    or a rendezvous elsewhere). Processes started afterwards inherit it."""
    if not host.startswith("127.") or "GLOO_SOCKET_IFNAME" in os.environ:
        return None
    loopback = next((name for _, name in socket.if_nameindex() if name.startswith("lo")), None)
    if loopback:
        os.environ["GLOO_SOCKET_IFNAME"] = loopback
    return loopback


def stop(processes: list, grace_seconds: float = STOP_GRACE_SECONDS) -> None:
    """SIGTERM, a grace period, then SIGKILL: nothing outlives the process that started them."""
    for p in processes:
        if p.is_alive():
            p.terminate()
    for p in processes:
        p.join(grace_seconds)
        if p.is_alive():
            p.kill()
            p.join()


def die_with_parent() -> None:
    """End this child process the moment the process that started it ends, however that one
    ended: otherwise a child orphaned by SIGKILL lingers, holding the job's terminal or log pipe
    open after the launcher has gone."""
    if sys.platform == "linux":
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG


def forward_signal(processes: list, signum: int) -> None:
    """Pass a signal on to the processes this one started (those still running)."""
    for p in processes:
        if p.is_alive():
            os.kill(p.pid, signum)


def all_reduce_sum(tensor: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    """Sum over ranks, in place; the identity without a process group."""
    if ctx.distributed:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def barrier(ctx: DistContext) -> None:
    if ctx.distributed:
        dist.barrier()


def all_reduce_min(tensor: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    if ctx.distributed:
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    return tensor


def broadcast_object(obj: Any, ctx: DistContext) -> Any:
    """Rank 0's `obj` on every rank."""
    if not ctx.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_objects(obj: Any, ctx: DistContext) -> list[Any]:
    if not ctx.distributed:
        return [obj]
    out: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(out, obj)
    return out


def broadcast_buffers(model: torch.nn.Module, ctx: DistContext) -> None:
    """Copy rank 0's buffers (BatchNorm running statistics) to every rank.

    DDP copies rank 0's buffers to the others as a training forward pass starts (not after one
    under no_sync), but without SyncBN each rank's forward then updates its copy from its own
    batch, so an epoch ends with statistics that differ by rank. Evaluating with rank 0's buffers everywhere makes the
    reported accuracy that of the checkpoint rank 0 saves, whatever the world size.
    """
    if not ctx.distributed:
        return
    for buffer in model.buffers():
        dist.broadcast(buffer, src=0)


class ShardSampler(Sampler[int]):
    """Rank r takes indices r, r + N, r + 2N, ... with no padding.

    DistributedSampler pads the last round with duplicates so every rank gets the same
    count; counted in an evaluation those duplicates shift the accuracy with the world size.
    Uneven shards are fine here because evaluation runs no collective per batch.
    """

    def __init__(self, length: int, ctx: DistContext):
        self.indices = range(ctx.rank, length, ctx.world_size)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)
