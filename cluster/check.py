"""`--check`: the user's own command line diagnoses the setup instead of training. Stages, each
under --check-timeout so that a hang becomes a verdict: what each process finds alone (its
first batch drawn as the run draws it), the rendezvous, the inventory gathered to rank 0, a
checked all-reduce, and the figures. Rank 0 prints one table (check_rows.py's verdicts); the
exit code says whether a job would run (0) or not (1)."""
from __future__ import annotations

import argparse
import atexit
import contextlib
import dataclasses
import datetime
import math
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from cluster.check_rows import (DDP_BUCKET_BYTES, FAIL, OK, Facts, Figures, Row, address_rows, figure_rows,
                                interface_rows, inventory_rows, local_rows, merged, nccl_transports, p2p_row,
                                rendezvous_row, report, sum_row)
from cluster.rendezvous import job_store
from model import create_model
from multi_train_utils.config import Plan
from multi_train_utils.distributed_utils import (DistContext, Ranks, broadcast_object, cpus_per_process,
                                                 gather_objects, job_precision, loader_options, parse_device,
                                                 process_context)
from multi_train_utils.train_eval_utils import Progress, build_optimizer, train_one_epoch
from my_dataset import EpochKeys, cache_short_side, default_workers, train_and_val_sets
from speed.image_cache import memory_available
from utils import ProjectError, UserError, record_for_torchrun, split_samples, stderr_line

LOADER_PREFETCH = 2  # batches each loader worker keeps ready (DataLoader's prefetch_factor)
T = TypeVar("T")


class StageTimeout(Exception):
    pass


def bounded(stage: str, timeout_s: float, fn: Callable[[], T], device: torch.device | None = None) -> T:
    """fn() in a thread, given `timeout_s`: a hang becomes StageTimeout, and the thread is left
    behind (a stuck socket or collective cannot be cancelled). A new thread's GPU is cuda:0: it
    takes the rank's `device` first (NCCL refuses an object collective's tensor on another GPU,
    pytorch/pytorch#115861)."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            if device is not None and device.type == "cuda":
                torch.cuda.set_device(device)
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


def gather_facts(plan: Plan, rdzv: Ranks | None) -> Facts:
    args = plan.args
    device = parse_device(args.device)
    local = rdzv.local_world_size if rdzv else 1
    world = rdzv.world_size if rdzv else 1
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    index = device.index if device.index is not None else (rdzv.local_rank if rdzv else 0)
    master, port = os.environ.get("MASTER_ADDR", ""), int(os.environ.get("MASTER_PORT", 0))
    return Facts(
        rank=rdzv.rank if rdzv else 0,
        host=socket.gethostname(),
        device=str(device) if device.type != "cuda" else f"cuda:{index}",
        gpu=str(torch.cuda.get_device_properties(index).uuid) if device.type == "cuda" and index < gpus else "",
        gpus_visible=gpus,
        local_world_size=local,
        nodes=int(os.environ.get("GROUP_WORLD_SIZE") or os.environ.get("SLURM_NNODES") or math.ceil(world / local)),
        backend=args.backend or ("nccl" if device.type == "cuda" else "gloo"),
        nccl_available=dist.is_nccl_available(),
        versions=versions(),
        socket_ifnames={k: v for k, v in sorted(os.environ.items()) if k.endswith("_SOCKET_IFNAME")},
        interfaces=tuple(name for _, name in socket.if_nameindex()),
        shm_free=shutil.disk_usage("/dev/shm").free if os.path.isdir("/dev/shm") else 0,
        memory_available=memory_available() if sys.platform == "linux" else 0,  # /proc/meminfo's
        loader_bytes=loader_bytes(args, device, local, cpus_per_process(rdzv or Ranks(0, 0, 1, 1))),
        cache_bytes=cache_bytes(args, len(plan.samples)),
        master=master,
        port=port,
        master_resolves_to=resolve(master) if master else (),
        hosts_store=hosts_store(rdzv),
        port_problem=port_problem(rdzv, master, port) if master and port else None,
    )


def versions() -> dict[str, str]:
    cuda = torch.cuda.is_available()
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if cuda and dist.is_nccl_available() else "-"
    try:
        driver = Path("/proc/driver/nvidia/version").read_text().split("Kernel Module")[1].split()[0] if cuda else "-"
    except (OSError, IndexError):
        driver = "unknown"
    return {"torch": torch.__version__, "CUDA": torch.version.cuda or "-", "NCCL": nccl, "driver": driver}


def loader_bytes(args: argparse.Namespace, device: torch.device, processes: int, cpus: int) -> int:
    """Batches in flight through /dev/shm: each worker of each process (of `cpus` CPUs) keeps
    LOADER_PREFETCH uint8 batches."""
    workers = default_workers(device, cpus) if args.workers is None else args.workers
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


def hosts_store(rdzv: Ranks | None) -> bool:
    """This process listens for the others: rank 0 of a job that torchrun's agent did not start."""
    return rdzv is not None and rdzv.rank == 0 and not rdzv.agent


def port_problem(rdzv: Ranks | None, host: str, port: int) -> str | None:
    """Whether this process can do its part at host:port now. The store's host must be able to
    listen there. A process alone (run on a node to test the way to the first) must reach it;
    in a job, reaching it is the rendezvous stage's, which waits for the first node to start.
    (A name that does not resolve is address_rows' to name.)"""
    try:
        if rdzv is None:
            socket.create_connection((host, port), timeout=1.0).close()
        elif hosts_store(rdzv):
            socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET).close()
    except OSError as e:
        why = os.strerror(e.errno) if e.errno else e  # create_server's own words add the address again
        return f"cannot {'reach' if rdzv is None else 'listen on'} {host}:{port}: {why}"
    return None


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


def first_batch(plan: Plan, ctx: DistContext) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's first training batch of epoch 1, drawn as the launchers draw it (their split,
    dataset, sampler and loader options), as train_one_epoch's loader of one batch. Drawn in this
    process: loader workers would outlive a check that gives up (os._exit) by a minute."""
    args = plan.args
    split = split_samples(plan.samples, plan.class_names, args.val_rate, args.seed, plan.val_files)
    train_set, _ = train_and_val_sets(split, args)
    sampler = DistributedSampler(train_set, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True, seed=args.seed)
    sampler.set_epoch(1)
    no_workers = argparse.Namespace(**{**vars(args), "workers": 0})
    return [next(iter(DataLoader(train_set, sampler=EpochKeys(sampler), **loader_options(no_workers, ctx))))]


def time_training_step(plan: Plan, batch: list[tuple[torch.Tensor, torch.Tensor]], amp_dtype: torch.dtype | None,
                       ctx: DistContext) -> tuple[float, int]:
    """Seconds of one training step on `batch` of the command line's model, built as the
    launchers build it: alone (`ctx` of no process group: the compute that communication is
    weighed against), or under DDP on every rank of `ctx`'s job at once; and the gradient's bytes."""
    args = plan.args
    torch.manual_seed(args.seed)
    model = create_model(len(plan.class_names), args.model, args.zero_init_residual, args.blurpool)
    model.to(ctx.device, memory_format=torch.channels_last if args.channels_last else torch.contiguous_format)
    if ctx.device.type == "cuda":  # as the run: cuDNN's kernels autotuned, in the warm-up here
        torch.backends.cudnn.benchmark = True
    model_without_ddp = model
    if ctx.distributed:  # broadcast: DDP copies rank 0's weights; backward() all-reduces the gradients
        model = DDP(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
    optimizer, scaler = build_optimizer(model_without_ddp, args, amp_dtype)
    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)
    # Warm-ups: kernels chosen, memory allocated; under DDP also its second step, which rebuilds
    # its buckets. Then one step timed: --check's stages are bounded by --check-timeout.
    for _ in range(2 if ctx.distributed else 1):
        train_one_epoch(model, criterion, optimizer, scaler, batch, 1, Progress(last_epoch=1), amp_dtype, args, ctx)
    started = time.perf_counter()
    # Ends with a host sync (its epoch sums read back); under DDP, all_reduces: the look and the sums.
    train_one_epoch(model, criterion, optimizer, scaler, batch, 1, Progress(last_epoch=1), amp_dtype, args, ctx)
    grad_bytes = sum(p.numel() * p.element_size() for p in model_without_ddp.parameters() if p.requires_grad)
    return time.perf_counter() - started, grad_bytes


# ---- the check itself


def check(plan: Plan, rdzv: Ranks | None) -> int:
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
    # Its device (its local rank's GPU) and its share of the CPUs; a GPU it cannot have: the run's own error.
    ctx = process_context(rdzv, plan.args.device, plan.args.backend)
    try:
        # As the run would draw it; an image that does not decode: the run's own error.
        batch = bounded("the first batch", timeout, lambda: first_batch(plan, ctx), ctx.device)
    except StageTimeout as e:
        give_up(rank, alone + local_rows(facts), Row("data", FAIL, str(e), "a hung file system under --data-path"))
    if rdzv is None:
        return report(alone + local_rows(facts) + figure_rows(step_figures(plan, ctx, batch)))
    if not (facts.master and facts.port):
        give_up(rank, alone + local_rows(facts), Row("master address", FAIL, "MASTER_ADDR and MASTER_PORT must both "
                                                     "be set", "export the first node's address and a free port"))
    if facts.port_problem or not facts.master_resolves_to:  # no rendezvous can happen
        give_up(rank, alone + local_rows(facts), next(r for r in address_rows(facts) if r.result == FAIL))
    if wrong_interface := interface_rows(facts):  # NCCL would fail at its first collective
        give_up(rank, alone + local_rows(facts), wrong_interface[0])
    if transport_log := nccl_log_file(facts.backend):
        os.environ.update(NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT,P2P,NET", NCCL_DEBUG_FILE=transport_log)
    try:
        with stderr_held():
            # Where the launchers meet: torchrun's processes at its agent's store, the spawn launcher's at torch's
            # env://; the others (srun's tasks, or started by hand) at rank 0's store, which names the missing.
            agentless = plan.launcher == "launch" and not rdzv.agent
            store = job_store(rdzv, timeout, option="--check-timeout") if agentless else None
            dist.init_process_group(ctx.backend, store=store, rank=ctx.rank, world_size=ctx.world_size,
                                    timeout=datetime.timedelta(seconds=timeout),
                                    device_id=ctx.device if ctx.device.type == "cuda" else None)
    except (ProjectError, RuntimeError) as e:  # torch's DistError is a RuntimeError
        if rank != 0 and isinstance(e, dist.DistNetworkError):  # rank 0 gave up, and its store went with it
            ended_by_rank_0(rank, "at the rendezvous")
        give_up(rank, alone + local_rows(facts), rendezvous_row(e, facts))
    try:
        everyone = bounded("the inventory", timeout, lambda: gather_objects(facts, ctx), ctx.device)
        # Now the machines are known, not guessed from the launcher's node count: several
        # torchrun agents on one machine may meet on loopback.
        machines = len({f.host for f in everyone})
        inventory = merged([local_rows(dataclasses.replace(f, nodes=machines)) for f in everyone])
        inventory += inventory_rows(everyone)
        collective, hung = collective_rows(ctx, facts, timeout, transport_log)
        if hung:
            give_up(rank, alone + inventory + collective, collective[-1])
        figures = bounded("the figures", 4 * timeout, lambda: step_figures(plan, ctx, batch), ctx.device)
    except StageTimeout as e:
        give_up(rank, alone, Row("collectives", FAIL, str(e), "a peer stopped answering: see its own line"))
    except Exception as e:
        if rank != 0 and isinstance(e, RuntimeError):  # rank 0 gave up, and its connections closed
            ended_by_rank_0(rank, "after the rendezvous")
        raise
    code = report(alone + inventory + collective + figure_rows(figures)) if ctx.is_main else 0
    code = broadcast_object(code, ctx)  # broadcast: rank 0's verdict is every rank's exit code
    dist.destroy_process_group()
    return code


@contextlib.contextmanager
def stderr_held() -> Iterator[None]:
    """What torch writes on stderr while the ranks meet, held back and written out once they have.
    A failed rendezvous is its rank's one line (give_up's): torch's C++ logs its own account of
    each failed try of a store's client with a C++ stack, and reads whether to log only once,
    when it is imported (TORCH_CPP_LOG_LEVEL)."""
    sys.stderr.flush()
    real_stderr = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(real_stderr, 2)
            os.close(real_stderr)
        held.seek(0)
        sys.stderr.write(held.read().decode(errors="replace"))
        sys.stderr.flush()


def give_up(rank: int, rows: list[Row], reason: Row) -> NoReturn:
    """End a check that cannot go on: each rank's own line (torchrun's summary shows it too), rank
    0's table, exit code 1. A timed-out stage may leave a thread stuck in a socket or a
    collective: no teardown."""
    line = stderr_line(f"rank {rank} on {socket.gethostname()}: {reason.check}: {reason.finding}")
    record_for_torchrun(ProjectError(line), line)
    if rank == 0:
        report(rows + ([] if reason in rows else [reason]))
    sys.stdout.flush()
    remove_left_behind()
    os._exit(1)


def ended_by_rank_0(rank: int, when: str) -> NoReturn:
    """A rank other than 0, whose check rank 0 ended (rank 0's output may be on another machine)."""
    give_up(rank, [], Row(f"rank 0 ended the check {when}", FAIL, "its table, in rank 0's output, says why"))


def output_row(plan: Plan) -> Row:
    """The run's own check of the output folder (create_run_folder's, with its error and exit
    code, without the configuration it prints). The folders made only for it are removed: a
    check leaves nothing behind."""
    near = Path(plan.args.output_dir or "runs")  # the default folder goes under runs/
    existed = {folder for folder in (near, *near.parents) if folder.exists()}
    path = plan.args.output_dir or f"runs/{plan.launcher}-{time.strftime('%Y%m%d-%H%M%S')}"
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / ".write-test").write_bytes(b"")
        (Path(path) / ".write-test").unlink()
    except OSError as e:
        raise UserError(f"cannot write to the output folder {path!r}: {e.strerror or e}") from None
    for folder in (Path(path), *Path(path).parents):
        if folder in existed or folder == Path("."):
            break
        folder.rmdir()
    return Row("output folder", OK, f"{path} is writable")


def data_row(plan: Plan) -> Row:
    classes = len({label for _, label in plan.samples})
    return Row("data", OK, f"{len(plan.samples)} images in {classes} classes under {plan.args.data_path} "
               "(listed, not decoded)")


def nccl_log_file(backend: str) -> str | None:
    """Where NCCL may write the INFO lines that name its transports: a new file of this process's
    own (a predictable name in a shared folder could be another user's link), removed when the
    process exits; not when the user set NCCL_DEBUG."""
    if backend != "nccl" or "NCCL_DEBUG" in os.environ:
        return None
    fd, path = tempfile.mkstemp(prefix="check-nccl-", suffix=".log")
    os.close(fd)
    LEFT_BEHIND.append(path)
    atexit.register(remove_left_behind)
    return path


# Files of this process's check, removed however it ends (give_up's os._exit skips atexit).
LEFT_BEHIND: list[str] = []


def remove_left_behind() -> None:
    for path in LEFT_BEHIND:
        Path(path).unlink(missing_ok=True)


def collective_rows(ctx: DistContext, facts: Facts, timeout: float, transport_log: str | None) -> tuple[list[Row], bool]:
    """A checked all-reduce; on NCCL, what P2P did and the transports chosen. And whether it
    hung, the reason then being the last row."""
    started, p2p_disabled = time.perf_counter(), os.environ.get("NCCL_P2P_DISABLE") == "1"
    try:
        total = bounded("the all-reduce", timeout, lambda: checked_sum(ctx), ctx.device)
    except StageTimeout as e:
        hung = p2p_row(p2p_disabled, "hung") if facts.backend == "nccl" else None
        return [hung or Row("all-reduce", FAIL, str(e), "a peer or a link stopped answering: see each rank's "
                            "line; NCCL_DEBUG=INFO shows where NCCL waits")], True
    rows = [sum_row(total, ctx.world_size, facts.backend, time.perf_counter() - started)]
    if facts.backend == "nccl":
        p2p = p2p_row(p2p_disabled, "ok")
        rows += [p2p] if p2p else []
        if transport_log and (found := nccl_transports(Path(transport_log).read_text(errors="replace"))):
            rows.append(Row("NCCL transport", OK, ", ".join(found)))
    return rows, False


def checked_sum(ctx: DistContext) -> float:
    """Each rank gives rank + 1; every element must come back as the same sum."""
    tensor = torch.full((1024,), float(ctx.rank + 1), device=ctx.device)
    dist.all_reduce(tensor)
    return float(tensor[0]) if bool((tensor == tensor[0]).all()) else float("nan")


def step_figures(plan: Plan, ctx: DistContext, batch: list[tuple[torch.Tensor, torch.Tensor]]) -> Figures:
    amp_dtype = job_precision(plan.args.amp, ctx)  # all_gather: the job's one precision, as the run takes it
    # Alone: no process group, so train_one_epoch's all_reduces are the identity.
    step_seconds, grad_bytes = time_training_step(plan, batch, amp_dtype, DistContext.single(ctx.device))
    figures = Figures(ctx.world_size, str(ctx.device), len(batch[0][1]), step_seconds, grad_bytes)
    if ctx.world_size == 1:
        return figures
    return dataclasses.replace(figures, bucket_seconds=time_all_reduce(DDP_BUCKET_BYTES, ctx),
                               grad_seconds=time_all_reduce(grad_bytes, ctx),
                               ddp_step_seconds=time_training_step(plan, batch, amp_dtype, ctx)[0])
