"""Process setup and teardown, and the few collectives the training loop needs.

Distributed state is a value: `setup_*` returns a frozen `DistContext` that the rest of the
code receives as an argument. Every reduction here is plain arithmetic when no process group
exists, so the single-process path runs the same code as DDP.
"""
from __future__ import annotations

import contextlib
import gc
import dataclasses
import datetime
import inspect
import multiprocessing
import multiprocessing.forkserver
import os
import re
import secrets
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import Sampler

from processes import attempt_store
from processes.helper_signals import ForkWithSigtermBlocked, sigterm_ignored_in_new_programs
from processes.rendezvous import (
    CHECK_ADVICE,
    JOIN_REPORT_SECONDS,
    Rendezvous,
    meeting_store,
    socket_interface_problem,
    store_host,
)
from utils import UserError, cpu_count, stderr_line

# Seconds the other processes of a job get to exit by themselves once one has failed, before
# SIGTERM, and again before SIGKILL (mp.spawn's own default waits 30 s at each stage).
STOP_GRACE_SECONDS = 5
# Before torch 2.8 (pytorch#154976), destroying a gloo group joins gloo's threads holding the GIL,
# while a thread may still be freeing the tensors of an object collective (broadcast_object,
# gather_objects), for which it needs the GIL: a deadlock. A pause after those lets it finish.
GLOO_TEARDOWN_PAUSE = 0.1 if tuple(int(p) for p in torch.__version__.split(".")[:2]) < (2, 8) else 0.0


@dataclasses.dataclass(frozen=True)
class DistContext:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    distributed: bool  # a process group exists (also true for a torchrun job of one process)
    # The rendezvous store, for what the ranks say to each other outside collectives, and which
    # process hosts it ("rank 0", "the spawn launcher", "torchrun's agent on the first node").
    store: dist.Store | None = dataclasses.field(default=None, compare=False, repr=False)
    store_host: str = "rank 0"

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
    if device.index is None and available == 1:
        # `srun --gpus-per-task=1` (and a CUDA_VISIBLE_DEVICES of one GPU per process) shows each
        # task its own GPU alone: that one, whatever the local rank. Two processes given the same
        # GPU this way fail in NCCL's start ("Duplicate GPU detected").
        index = 0
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


def init_distributed(rdzv: Rendezvous | None, device_spec: str | None, backend: str | None = None,
                     timeout_s: float = 1800, report_every_s: float = JOIN_REPORT_SECONDS,
                     advice: str = CHECK_ADVICE) -> DistContext:
    """This process's place in its job: its device (on CUDA, its local rank's GPU), its share of
    the CPU cores, and the process group it joins with `dist.init_process_group` (NCCL on GPUs,
    gloo on the CPU, `backend` to choose), meeting the others where `meeting_store` says.
    `timeout_s` bounds the meeting and every collective: a missing, dead or stuck peer becomes
    an error, not a hang. Without a job (`rdzv` None): one process, no process group."""
    if rdzv is None:
        return setup_single(device_spec)
    device = resolve_device(device_spec, rdzv.local_rank, rdzv.local_world_size, distributed=True)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    if problem := socket_interface_problem(backend):  # gloo would fail deep in its C++, NCCL hang
        raise UserError(f"rank {rdzv.rank}: {problem}")
    _configure_threads(device, rdzv.local_world_size)
    where, store = meeting_store(rdzv, timeout_s, report_every_s, advice)
    if attempt_store.needed(rdzv):  # torchrun's agent's store outlives this attempt: one of its own
        where, store = attempt_store.attempt_store(store, rdzv.rank, where, timeout_s)
    # init_process_group sets its timeout only on a store it makes itself, and NCCL's start (rank
    # 0's unique id) and the fault watch wait on this one: --dist-timeout, not a client's 5 s.
    store.set_timeout(datetime.timedelta(seconds=timeout_s))
    dist.init_process_group(
        backend=backend,
        rank=rdzv.rank,
        world_size=rdzv.world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
        store=store,
        # Binding the group to this rank's GPU lets NCCL connect eagerly and avoids
        # "devices used by this process are currently unknown" warnings in barrier().
        device_id=device if backend == "nccl" else None,
    )
    # The job's own keys (faults.py's) go under a name rank 0 draws now: under torchrun the store
    # outlives this attempt, and keys of an earlier one must never be read as this one's.
    job = DistContext(rdzv.rank, rdzv.local_rank, rdzv.world_size, rdzv.local_world_size, device, distributed=True)
    namespace = broadcast_object(f"job-{secrets.token_hex(6)}/" if rdzv.rank == 0 else None, job)
    host = "rank 0" if attempt_store.needed(rdzv) else store_host(rdzv)  # the attempt's store is rank 0's
    ctx = dataclasses.replace(job, store=dist.PrefixStore(namespace, store), store_host=host)
    ctx.print0(f"process group: backend={backend}, world_size={rdzv.world_size}, rendezvous={where}, "
               f"threads per process={torch.get_num_threads()}")
    return ctx


def teardown() -> None:
    if dist.is_available() and dist.is_initialized():
        time.sleep(GLOO_TEARDOWN_PAUSE)
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


def prepare_helper_start(ctx: DistContext) -> multiprocessing.context.BaseContext:
    """How this process starts its helpers (loader workers, plotters), the fork server started
    now where one is needed (its imports then go on beside this process). Forking shares the
    parent's memory and imports; but in a process group gloo's (or NCCL's) threads, and on CUDA
    autograd's, create Python thread states now and then, to drop a tensor's Python object, and
    a fork that catches one of them holding CPython's runtime lock leaves a child that waits for
    it forever, before it runs a line: CPython before 3.11.10 (and 3.12.0), python/cpython#112275.
    Its training process then waits for batches that never come. There the helpers are forked
    from a fork server instead, a process without threads that imports torch once. Elsewhere
    they are forked with SIGTERM blocked (helper_signals.py says why)."""
    fixed = sys.version_info >= (3, 12, 1) or (3, 11, 10) <= sys.version_info < (3, 12)
    if fixed or not (ctx.distributed or ctx.device.type == "cuda"):
        return ForkWithSigtermBlocked()
    server = multiprocessing.get_context("forkserver")
    server.set_forkserver_preload(["processes.fork_server_start", "torch", "torchvision", "my_dataset",
                                   "multi_train_utils.loaders", "plots"])
    # Now: it imports those while this process goes on. Ignoring SIGTERM from its start, not
    # only from fork_server_start on (seconds of imports later): a SIGTERM meant for the job
    # (SLURM's warning, a preemption) would kill it meanwhile, and the first loader waiting
    # for a worker from it would fail the run instead of saving its position.
    with sigterm_ignored_in_new_programs():
        multiprocessing.forkserver.ensure_running()
    return server


def keep_inherited_objects() -> None:
    """In a forked child: never garbage-collect what the parent left in memory. A finalizer of
    one of those (a library's thread pool, say onnxruntime's) may wait on a lock that a thread of
    the parent held at the fork, a thread the child does not have: the child would hang there.
    It also spares the parent's pages the copies a collection's writes would make."""
    gc.freeze()


def forward_signal(processes: list, signum: int) -> None:
    """Pass a signal on to the processes this one started (those still running)."""
    for p in processes:
        if p.is_alive():
            os.kill(p.pid, signum)


@contextlib.contextmanager
def passing_sigterm_on() -> Iterator[Callable[[list], None]]:
    """A SIGTERM sent to this process alone (a scheduler signals the launcher) passed on to the
    processes given to the function it yields: they then save where they are and exit (75). In
    effect from before they start until the block ends (the launcher joins them inside it): a
    SIGTERM that came while they were starting is passed on as they are given."""
    processes: list = []
    came: list[int] = []

    def pass_on(*_: object) -> None:
        came.append(signal.SIGTERM)
        forward_signal(processes, signal.SIGTERM)

    def started(new: list) -> None:
        processes.extend(new)
        if came:  # it came while they were starting, before they were in the list
            forward_signal(new, signal.SIGTERM)

    previous = signal.signal(signal.SIGTERM, pass_on)
    try:
        yield started
    finally:
        signal.signal(signal.SIGTERM, previous)


def join_processes(context: Any) -> int:
    """Wait for the processes of an mp.spawn `context`, and the job's exit code. Once one has
    failed, torch's ProcessContext.join gives the others STOP_GRACE_SECONDS to end, then sends
    SIGTERM, waits as long again, then SIGKILL. Ctrl-C ends them all (130)."""
    # The others' time to end by themselves once one has failed; torch 2.5's join has no grace
    # period and sends them SIGTERM at once (then SIGKILL 30 s later).
    grace = {"grace_period": STOP_GRACE_SECONDS} if "grace_period" in inspect.signature(context.join).parameters else {}
    try:
        while not context.join(**grace):
            pass
    except mp.ProcessExitedException as e:
        # The process printed its own `error:` line unless a signal gave it no chance to.
        if e.signal_name:
            stderr_line(f"error: process {e.error_index} was killed by {e.signal_name}")
        return e.exit_code if e.exit_code > 0 else 1
    except mp.ProcessRaisedException as e:
        stderr_line(str(e))  # the failing rank's traceback
        return 1
    except KeyboardInterrupt:
        stop(context.processes)
        stderr_line("interrupted")
        return 130
    return 0


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
    time.sleep(GLOO_TEARDOWN_PAUSE)  # torch 2.5-2.7: so that a teardown right after it cannot deadlock
    return box[0]


def gather_objects(obj: Any, ctx: DistContext) -> list[Any]:
    if not ctx.distributed:
        return [obj]
    out: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(out, obj)
    time.sleep(GLOO_TEARDOWN_PAUSE)  # as in broadcast_object
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
    batch, so an epoch ends with statistics that differ by rank. Evaluating with rank 0's buffers
    everywhere makes the reported accuracy that of the checkpoint rank 0 saves, whatever the
    world size. One broadcast per dtype (BatchNorm's: float statistics, int64 batch counts), of
    the buffers laid end to end: a ResNet has over a hundred, one broadcast each a hundred waits.
    """
    if not ctx.distributed:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for buffer in model.buffers():
        by_dtype.setdefault(buffer.dtype, []).append(buffer)
    for buffers in by_dtype.values():
        flat = torch.cat([b.detach().reshape(-1) for b in buffers])
        dist.broadcast(flat, src=0)
        for buffer, value in zip(buffers, flat.split([b.numel() for b in buffers])):
            buffer.detach().copy_(value.view_as(buffer))


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
