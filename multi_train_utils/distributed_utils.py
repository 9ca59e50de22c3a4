"""Who this process is, its device and share of the CPUs, and the few collectives the launchers
call by name.

Distributed state is a value: `process_context` returns a frozen `DistContext` that the rest of
the code receives as an argument. Each collective helper here is named for the collective it
makes, and is plain arithmetic when no process group exists, so one process runs the same code.
"""
from __future__ import annotations

import dataclasses
import multiprocessing
import os
import signal
import socket
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from my_dataset import default_workers
from utils import UserError, cpu_count

# Before torch 2.8 (pytorch#154976), destroying a gloo group joins gloo's threads holding the GIL, while one
# may still be freeing the tensors of an object collective, for which it needs the GIL: a deadlock. A pause
# after those lets it finish.
GLOO_TEARDOWN_PAUSE = 0.1 if tuple(int(p) for p in torch.__version__.split(".")[:2]) < (2, 8) else 0.0


@dataclasses.dataclass(frozen=True)
class Ranks:
    """Who this process is in its job, as torchrun, srun or the spawn launcher started it."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    srun_task: bool = False  # a task srun started: the CPUs SLURM gave it are its own
    agent: bool = False  # torchrun's agent started it: the processes meet at the agent's store
    restart: int = 0  # torchrun's restarts of the group (--max-restarts) that meet at that same store


@dataclasses.dataclass(frozen=True)
class DistContext:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    distributed: bool  # a process group exists (also for a torchrun job of one process)
    backend: str = "gloo"  # --backend, else NCCL on GPUs and gloo on the CPU
    cpus: int = 1  # the CPUs this process may take: its math threads, its loader workers and itself

    @classmethod
    def single(cls, device: torch.device = torch.device("cpu")) -> DistContext:
        """One process, no process group."""
        return cls(0, 0, 1, 1, device, distributed=False, cpus=cpu_count())

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def print0(self, *args: Any, **kwargs: Any) -> None:
        if self.is_main:
            print(*args, **kwargs, flush=True)


def env_ranks(local_rank_arg: int | None = None) -> Ranks | None:
    """Who this process is, from torchrun's environment (the legacy launcher without --use_env passes
    --local-rank instead of LOCAL_RANK); None without it (srun's: cluster/rendezvous.py)."""
    env = os.environ
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    local_rank = int(env.get("LOCAL_RANK", local_rank_arg if local_rank_arg is not None else 0))
    return Ranks(int(env["RANK"]), local_rank, int(env["WORLD_SIZE"]), int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])),
                 agent="TORCHELASTIC_RUN_ID" in env, restart=int(env.get("TORCHELASTIC_RESTART_COUNT", 0))
                 if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" else 0)


def parse_device(spec: str | None) -> torch.device:
    """`--device` as written: None is CUDA when present, else the CPU; N is GPU N (the original's)."""
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
    """This process's device: `--device`'s type, on CUDA the GPU of its local rank."""
    device = parse_device(spec)
    return local_gpu(device, spec, local_rank, local_world_size, distributed) if device.type == "cuda" else device


def local_gpu(device: torch.device, spec: str | None, local_rank: int, local_world_size: int,
              distributed: bool) -> torch.device:
    """The GPU of this process's local rank (a GPU named by its index is for one process alone)."""
    available = torch.cuda.device_count()
    if available == 0:
        raise UserError(f"--device {spec} asked for CUDA, but no GPU is visible")
    if distributed and device.index is not None and (local_world_size > 1 or device.index != local_rank):
        raise UserError(f"--device {spec} names GPU {device.index}, but in a job each process takes the GPU of its "
                        f"local rank ({local_world_size} process(es) on this machine): pass --device cuda, and choose "
                        "the GPUs with CUDA_VISIBLE_DEVICES")
    # `srun --gpus-per-task=1` (or a CUDA_VISIBLE_DEVICES of one GPU per process) shows each process its own GPU alone.
    index = device.index if device.index is not None else 0 if available == 1 else local_rank
    if index >= available:
        raise UserError(f"this process wants GPU {index}, but only {available} GPU(s) are visible: "
                        f"start at most {available} process(es) per machine")
    return torch.device("cuda", index)


def cpus_per_process(ranks: Ranks) -> int:
    """The CPUs this process may take: those SLURM gave its task where srun started it, else its
    share, with the other processes of its machine, of those it may run on (taskset, a cpuset)."""
    if ranks.srun_task and "SLURM_CPUS_PER_TASK" in os.environ:
        return max(1, min(cpu_count(), int(os.environ["SLURM_CPUS_PER_TASK"])))
    return max(1, cpu_count() // ranks.local_world_size)


def process_context(ranks: Ranks | None, device_spec: str | None, backend: str | None = None) -> DistContext:
    """This process's device (its local rank's GPU, made current), CPUs and backend (`ranks` None:
    one process). Its math threads: its CPUs, unless OMP_NUM_THREADS says (torchrun sets 1)."""
    job = ranks or Ranks(0, 0, 1, 1)
    device = resolve_device(device_spec, job.local_rank, job.local_world_size, distributed=ranks is not None)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    cpus = cpus_per_process(job)
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(cpus)
    return DistContext(job.rank, job.local_rank, job.world_size, job.local_world_size, device,
                       distributed=ranks is not None, backend=backend or ("nccl" if device.type == "cuda" else "gloo"),
                       cpus=cpus)


def autocast_dtype(choice: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype `--amp` asks for on `device`, or None for fp32. auto: bf16 where the
    hardware runs it natively, fp16 (with loss scaling) on older GPUs, else fp32."""
    if choice != "auto":
        return {"off": None, "fp16": torch.float16, "bf16": torch.bfloat16}[choice]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else torch.float16
    # Without native bf16 instructions the CPU emulates it, slower than fp32; so do torch's and oneDNN's
    # kernels held below AVX512 (ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2: 3.5x slower measured).
    cpu, isa = torch.cpu, os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").upper()
    native = getattr(cpu, "_is_avx512_bf16_supported", lambda: False)() or getattr(cpu, "_is_amx_tile_supported", lambda: False)()
    capped = isa.startswith(("SSE", "AVX2")) or isa in ("AVX", "AVX512_CORE", "AVX512_CORE_VNNI")
    return torch.bfloat16 if native and torch.backends.cpu.get_cpu_capability() == "AVX512" and not capped else None


def job_precision(choice: str, ctx: DistContext) -> torch.dtype | None:
    """One autocast dtype for the job, the one every rank runs natively (fp32 before fp16 before
    bf16): ranks in different precisions would take different steps, and the copies of the model
    would silently part. Collective: an all_gather."""
    order = [None, torch.float16, torch.bfloat16]
    dtype = min(gather_objects(autocast_dtype(choice, ctx.device), ctx), key=order.index)
    ctx.print0(f"precision: {'fp32' if dtype is None else str(dtype).removeprefix('torch.') + ' autocast'}")
    return dtype


def broadcast_object(obj: Any, ctx: DistContext) -> Any:
    """Rank 0's `obj` on every rank."""
    if not ctx.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    time.sleep(GLOO_TEARDOWN_PAUSE)
    return box[0]


def gather_objects(obj: Any, ctx: DistContext) -> list[Any]:
    """Every rank's `obj`, in rank order, on every rank."""
    if not ctx.distributed:
        return [obj]
    out: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(out, obj)
    time.sleep(GLOO_TEARDOWN_PAUSE)
    return out


def all_reduce_sum(tensor: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    """Sum over ranks, in place; the identity without a process group."""
    if ctx.distributed:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_reduce_min(tensor: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    """The smallest over ranks, in place; the identity without a process group."""
    if ctx.distributed:
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    return tensor


def barrier(ctx: DistContext) -> None:
    if ctx.distributed:
        dist.barrier()


def raise_together(problem: str | None, ctx: DistContext) -> None:
    """Raise `problem` on every rank as soon as one rank has it (machines differ in free memory):
    a rank that raised alone would leave the others waiting in their next collective until
    --dist-timeout. Collective: an all_gather, so that the ranks agree before they part."""
    found = gather_objects((socket.gethostname(), problem) if problem else None, ctx)
    failing = [(rank, entry) for rank, entry in enumerate(found) if entry]
    if not failing:
        return
    rank, (host, first) = failing[0]
    where = f"rank {rank} on {host}" + (f" (and {len(failing) - 1} other rank(s))" if len(failing) > 1 else "")
    raise UserError(f"{where}: {first}" if ctx.distributed else first)


def broadcast_buffers(model: torch.nn.Module, ctx: DistContext) -> None:
    """Rank 0's buffers (BatchNorm's running statistics) on every rank: without --sync-bn each
    rank's follow its own batches. One broadcast per dtype, the buffers laid end to end: a ResNet
    has over a hundred, a broadcast each would be a hundred waits."""
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


def loader_options(args: Any, ctx: DistContext) -> dict[str, Any]:
    """The DataLoaders' batch, workers (its CPUs less one, kept between epochs), pinned memory for a GPU.
    Before CPython 3.11.10 a fork that catches gloo's, NCCL's or autograd's thread holding the runtime
    lock hangs (python/cpython#112275): there workers fork from a fork server (fork_server.py)."""
    workers = default_workers(ctx.device, ctx.cpus) if args.workers is None else args.workers
    affected = sys.version_info < (3, 11, 10) or (3, 12) <= sys.version_info < (3, 12, 1)
    context = None
    if workers and affected and sys.platform == "linux" and (ctx.distributed or ctx.device.type == "cuda"):
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["multi_train_utils.fork_server", "torch", "torchvision", "my_dataset"])
    return dict(batch_size=args.batch_size, num_workers=workers, persistent_workers=workers > 0,
                worker_init_fn=leave_sigterm_to_trainer, pin_memory=ctx.device.type == "cuda",
                multiprocessing_context=context)


def leave_sigterm_to_trainer(worker_id: int) -> None:
    """In a loader worker: ignore SIGTERM, which SLURM and torchrun send every process of a job: the
    training process acts on it, and needs its workers until it has saved (they end with it)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


class ShardSampler(Sampler[int]):
    """Rank r takes indices r, r + N, r + 2N, ... with no padding. DistributedSampler pads the last
    round with duplicates so every rank gets the same count; counted in an evaluation, those
    duplicates would shift the accuracy with the world size."""

    def __init__(self, length: int, ctx: DistContext):
        self.indices = range(ctx.rank, length, ctx.world_size)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)
