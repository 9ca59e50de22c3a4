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
import re
import signal
import socket
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from multi_train_utils.rendezvous import (
    CHECK_ADVICE,
    JOIN_REPORT_SECONDS,
    connect_store,
    env_store,
    socket_interface_problem,
    wait_for_ranks,
)
from utils import UserError, cpu_count

# Seconds the other processes of a job get to exit by themselves once one has failed, before
# SIGTERM, and again before SIGKILL (mp.spawn's own default waits 30 s at each stage).
STOP_GRACE_SECONDS = 5


@dataclasses.dataclass(frozen=True)
class DistContext:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    distributed: bool  # a process group exists (also true for a torchrun job of one process)
    # The rendezvous store, for what the ranks say to each other outside collectives.
    store: dist.Store | None = dataclasses.field(default=None, compare=False, repr=False)

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
    advice: str = CHECK_ADVICE,
) -> DistContext:
    """Join the process group of the given ranks: through the store at `store_address`
    (hosted by the spawn launcher), else through MASTER_ADDR/MASTER_PORT (torchrun, SLURM).
    `timeout_s` bounds the rendezvous and every collective: a missing, dead or stuck peer
    becomes an error, not a hang. While processes are missing, rank 0 says which, every
    `report_every_s` seconds; `advice` follows the names of the missing when it gives up."""
    device = resolve_device(device_spec, local_rank, local_world_size, distributed=True)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    if problem := socket_interface_problem(backend):  # gloo would fail deep in its C++, NCCL hang
        raise UserError(f"rank {rank}: {problem}")
    _configure_threads(device, local_world_size)
    timeout = datetime.timedelta(seconds=timeout_s)
    if store_address is not None:
        host, port = store_address
        store = connect_store(host, port, rank, timeout_s, report_every_s)
    else:
        host, port, store = env_store(rank, world_size, timeout_s, report_every_s)
    wait_for_ranks(store, rank, world_size, local_world_size, f"{host}:{port}", timeout_s, report_every_s, advice)
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
    ctx = DistContext(rank, local_rank, world_size, local_world_size, device, distributed=True, store=store)
    ctx.print0(
        f"process group: backend={backend}, world_size={world_size}, "
        f"rendezvous={host}:{port}, "
        f"threads per process={torch.get_num_threads()}"
    )
    return ctx


def teardown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


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


# How gloo, NCCL and the store say that the other end of a connection went away.
LOST_CONNECTION = re.compile(r"Connection (closed|reset) by peer|Broken pipe|remote process exited|Connection refused|"
                             r"network error|failed to recv|Socket Timeout|GLHF", re.IGNORECASE)


def lost_connection(error: BaseException) -> bool:
    """Whether `error`, from a collective or the store, says that the connection to a peer broke."""
    return isinstance(error, RuntimeError) and bool(LOST_CONNECTION.search(str(error)))


def raise_together(problem: str | None, ctx: DistContext) -> None:
    """Raise `problem` on every rank as soon as one rank has it. Machines differ in
    free memory: a rank that raised alone would leave the others waiting in their next collective
    until --dist-timeout. Costs one gather, so the ranks agree before they part."""
    found = gather_objects((socket.gethostname(), problem) if problem else None, ctx)
    failing = [(rank, entry) for rank, entry in enumerate(found) if entry]
    if not failing:
        return
    rank, (host, first) = failing[0]
    where = f"rank {rank} on {host}" + (f" (and {len(failing) - 1} other rank(s))" if len(failing) > 1 else "")
    raise UserError(f"{where}: {first}" if ctx.distributed else first)


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
