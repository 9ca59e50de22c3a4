"""Process setup and teardown, and the few collectives the training loop needs.

Distributed state is a value: `process_context` returns a frozen `DistContext` that the rest of
the code receives as an argument. Every reduction here is plain arithmetic when no process group
exists, so the single-process path runs the same code as DDP.
"""
from __future__ import annotations

import dataclasses
import datetime
import gc
import inspect
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.resource_tracker
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
import torch.multiprocessing as mp
from torch.utils.data import Sampler

from processes.helper_signals import ForkWithSigtermBlocked, sigterm_blocked
from utils import ProjectError, UserError, cores_per_process, stderr_line

# Seconds a job started one process at a time (srun, by hand) has to meet before rank 0 names
# the missing (torchrun's agents wait themselves: --rdzv-conf join_timeout).
JOIN_SECONDS = 60
# Seconds the other processes of a job get to exit by themselves once one has failed, before
# SIGTERM, and again before SIGKILL (mp.spawn's own default waits 30 s at each stage).
STOP_GRACE_SECONDS = 5
# Before torch 2.8 (pytorch#154976), destroying a gloo group joins gloo's threads holding the GIL,
# while a thread may still be freeing the tensors of an object collective (broadcast_object,
# gather_objects), for which it needs the GIL: a deadlock. A pause after those lets it finish.
GLOO_TEARDOWN_PAUSE = 0.1 if tuple(int(p) for p in torch.__version__.split(".")[:2]) < (2, 8) else 0.0


@dataclasses.dataclass(frozen=True)
class Ranks:
    """Who this process is in its job, as torchrun, srun or the spawn launcher started it."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int


@dataclasses.dataclass(frozen=True)
class DistContext:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    distributed: bool  # a process group exists (also true for a torchrun job of one process)
    backend: str = "gloo"  # the process group's: --backend, else NCCL on GPUs and gloo on the CPU

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


def env_ranks(local_rank_arg: int | None = None) -> Ranks | None:
    """Who this process is, from torchrun's or SLURM's environment; None when neither started it.

    torchrun and `torch.distributed.launch --use_env` export RANK/LOCAL_RANK/WORLD_SIZE; the
    legacy launcher without --use_env passes --local-rank instead of LOCAL_RANK. Under `srun`
    one task is one process, described by SLURM_PROCID/SLURM_LOCALID/SLURM_NTASKS; the job
    script exports MASTER_ADDR/MASTER_PORT (flowers.sbatch).
    """
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        world_size = int(env["WORLD_SIZE"])
        local_rank = int(env.get("LOCAL_RANK", local_rank_arg if local_rank_arg is not None else 0))
        return Ranks(int(env["RANK"]), local_rank, world_size, int(env.get("LOCAL_WORLD_SIZE", world_size)))
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in env]
        if missing:
            raise UserError(f"running under SLURM but {' and '.join(missing)} is not set: export the first "
                            "node's address and a free port in the job script (flowers.sbatch does)")
        world_size, nodes = int(env["SLURM_NTASKS"]), int(env.get("SLURM_NNODES", "1"))
        per_node = int(env.get("SLURM_NTASKS_PER_NODE", "0").split("(")[0] or 0) or max(1, world_size // nodes)
        return Ranks(int(env["SLURM_PROCID"]), int(env.get("SLURM_LOCALID", "0")), world_size, per_node)
    return None


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
    torch.set_num_threads(cores_per_process(local_world_size))


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


def process_context(ranks: Ranks | None, device_spec: str | None, backend: str | None = None) -> DistContext:
    """This process's device (on CUDA its local rank's GPU, made current), share of the CPU
    cores and process group backend (`backend`, else NCCL on GPUs and gloo on the CPU), before
    any process group; `ranks` None: one process."""
    job = ranks or Ranks(0, 0, 1, 1)
    device = resolve_device(device_spec, job.local_rank, job.local_world_size, distributed=ranks is not None)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    _configure_threads(device, job.local_world_size)
    return DistContext(job.rank, job.local_rank, job.world_size, job.local_world_size, device,
                       distributed=ranks is not None, backend=backend or ("nccl" if device.type == "cuda" else "gloo"))


def job_store(ranks: Ranks, timeout_s: float) -> dist.Store | None:
    """The store `dist.init_process_group` meets at where torch's env:// falls short; else None.
    Under torchrun each attempt takes a prefix of its own in the agent's store, which keeps the
    last attempt's keys (gloo's addresses: pytorch/pytorch#135712). A job started one process at
    a time (srun, the spawn launcher, by hand) meets at rank 0's store, and the missing ranks are
    named after JOIN_SECONDS (torch's env:// would wait --dist-timeout and name no one)."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
            return None  # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: rank 0 hosts a new store each attempt
        agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=datetime.timedelta(seconds=timeout_s))
        return dist.PrefixStore(f"attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/", agent)
    try:
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    except (KeyError, ValueError):
        raise UserError("MASTER_ADDR and MASTER_PORT must be set to the address of rank 0's machine and a "
                        "free port") from None
    join = datetime.timedelta(seconds=min(JOIN_SECONDS, timeout_s))
    try:
        store = dist.TCPStore(host, port, ranks.world_size, is_master=ranks.rank == 0, timeout=join,
                              wait_for_workers=False)
    except dist.DistError as e:
        why = (str(e).strip().splitlines() or [type(e).__name__])[-1]
        raise ProjectError(f"rank {ranks.rank} on {socket.gethostname()}: no rendezvous at {host}:{port} within "
                           f"{join.seconds} s ({why}): is rank 0 running there, and is the port free and open?") from None
    store.set(f"joined/{ranks.rank}", socket.gethostname())
    if ranks.rank == 0:
        try:
            store.wait([f"joined/{r}" for r in range(ranks.world_size)], join)
        except dist.DistError:
            missing = [r for r in range(ranks.world_size) if not store.check([f"joined/{r}"])]
            names = ", ".join(f"rank {r}" for r in missing[:8]) + (" and more" if len(missing) > 8 else "")
            raise ProjectError(f"{ranks.world_size - len(missing)} of {ranks.world_size} processes joined at "
                               f"{host}:{port} within {join.seconds} s; missing: {names}") from None
    store.set_timeout(datetime.timedelta(seconds=timeout_s))  # NCCL's start waits on it as long as a collective
    return store


def init_distributed(ranks: Ranks | None, device_spec: str | None, backend: str | None = None,
                     timeout_s: float = 1800) -> DistContext:
    """process_context and, in a job, `dist.init_process_group`, as the launchers write them out."""
    ctx = process_context(ranks, device_spec, backend)
    if ctx.distributed:
        dist.init_process_group(ctx.backend, store=job_store(ranks, timeout_s), rank=ctx.rank,
                                world_size=ctx.world_size, timeout=datetime.timedelta(seconds=timeout_s))
    return ctx


def setup_single(device_spec: str | None) -> DistContext:
    return process_context(None, device_spec)


def teardown() -> None:
    if dist.is_available() and dist.is_initialized():
        time.sleep(GLOO_TEARDOWN_PAUSE)
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
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def meeting_point(args: Any) -> None:
    """Where the spawn launcher's processes meet, exported for them: --dist-url, else MASTER_ADDR
    and MASTER_PORT, else a free port on 127.0.0.1; on loopback, gloo stays there too."""
    host, port = parse_dist_url(args.dist_url) or (os.environ.get("MASTER_ADDR", "127.0.0.1"),
                                                    int(os.environ.get("MASTER_PORT", "0")))
    os.environ.update(MASTER_ADDR=host, MASTER_PORT=str(port or find_free_port(host)))
    if (host.startswith("127.") or host == "::1") and "GLOO_SOCKET_IFNAME" not in os.environ:
        loopback = next((name for _, name in socket.if_nameindex() if name.startswith("lo")), None)
        if loopback:
            os.environ["GLOO_SOCKET_IFNAME"] = loopback
            print(f"GLOO_SOCKET_IFNAME={loopback} (gloo stays on loopback)")


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
    """How this process starts its helpers (loader workers, plotters). Forking shares the parent's
    memory and imports; but in a process group gloo's (or NCCL's) threads, and on CUDA autograd's,
    create Python thread states now and then, and a fork that catches one holding CPython's
    runtime lock leaves a child that waits for it forever, and the training process for batches
    that never come: CPython before 3.11.10 (and 3.12.0), python/cpython#112275. There the helpers
    are forked from a fork server, a process without threads that imports torch once. Elsewhere
    they are forked with SIGTERM blocked (helper_signals.py)."""
    fixed = sys.version_info >= (3, 12, 1) or (3, 11, 10) <= sys.version_info < (3, 12)
    if fixed or not (ctx.distributed or ctx.device.type == "cuda"):
        return ForkWithSigtermBlocked()
    server = multiprocessing.get_context("forkserver")
    server.set_forkserver_preload(["processes.fork_server_start", "torch", "torchvision", "my_dataset",
                                   "multi_train_utils.loaders", "plots"])
    # Started now, its imports beside this process. A SIGTERM for the job (SLURM's warning) must
    # not kill it before fork_server_start ignores it: it starts with the signal blocked (exec
    # keeps the mask), blocked in this thread alone, so that this process's other threads (gloo's,
    # NCCL's) still take one. The resource tracker first: its start unblocks SIGTERM.
    multiprocessing.resource_tracker.ensure_running()
    with sigterm_blocked():
        multiprocessing.forkserver.ensure_running()
    return server


def keep_inherited_objects() -> None:
    """In a forked child: never garbage-collect what the parent left in memory. A finalizer of
    one of those (a library's thread pool, say onnxruntime's) may wait on a lock that a thread of
    the parent held at the fork, a thread the child does not have: the child would hang there.
    It also spares the parent's pages the copies a collection's writes would make."""
    gc.freeze()


def join_processes(context: Any, sigterm_came: Any) -> int:
    """Wait for the processes of an mp.spawn `context`; the job's exit code. Once one has failed,
    torch's join gives the others STOP_GRACE_SECONDS, then SIGTERM, as long again, then SIGKILL;
    Ctrl-C ends them all (130). Once `sigterm_came` is set, SIGTERM is passed on each second: a
    process still starting at the first had no handler yet (it ignores SIGTERM until then)."""
    # The others' time to end by themselves once one has failed; torch 2.5's join has no grace
    # period and sends them SIGTERM at once (then SIGKILL 30 s later).
    grace = {"grace_period": STOP_GRACE_SECONDS} if "grace_period" in inspect.signature(context.join).parameters else {}
    try:
        while not context.join(timeout=1, **grace):
            if sigterm_came.is_set():
                for p in context.processes:
                    if p.is_alive():
                        os.kill(p.pid, signal.SIGTERM)
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
