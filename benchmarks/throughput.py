"""The throughput experiment: training images/s, loader images/s, epoch time and memory of
each configuration, world size and input, each measured in fresh processes."""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import json
import multiprocessing
import os
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from benchmarks.instruments import MemorySampler, Run, StepTimer, data_of_size, rank_rate, vm_hwm_mb, write_result
from benchmarks.ours_recipe import OURS_OPTIONS, SAME_SYNTHETIC_AS_OURS, missing_option, ours_plan
from benchmarks.seed_recipe import seed_loader, seed_model_and_optimizer, seed_train_one_epoch, seed_transforms
from benchmarks.throughput_report import plot_throughput, summarise, throughput_table
from model import cpu_sync_batchnorm, model_for
from multi_train_utils.config import Plan
from multi_train_utils.distributed_utils import (
    DistContext,
    Ranks,
    ShardSampler,
    autocast_dtype,
    gather_objects,
    loader_options,
    process_context,
)
from multi_train_utils.resume import readable_split
from multi_train_utils.train_eval_utils import Extras, Progress, build_optimizer, train_one_epoch
from my_dataset import EpochKeys, train_and_val_sets
from recipe import extras
from utils import DataSplit, UserError, exit_on_error

JOB_TIMEOUT_SECONDS = 1200  # one measurement; a hung process group must not stall the whole benchmark

DEFINITIONS = {
    "images_per_sec": "steady-state training images/s summed over processes: batch x steps / time of the "
                      "steps after warm-up, per process; median over repetitions in the summary",
    "loader_images_per_sec": "the training loader alone (no model step), same processes and steps",
    "epoch_seconds_extrapolated": "training images of the split / images_per_sec + first_batch_seconds: "
                                  "extrapolated from the steady-state rate, not timed; excludes evaluation",
    "first_batch_seconds": "wait for an epoch's first batch (real input: the second epoch, as every "
                           "later one starts: the seed starts new loader workers, ours refills its own)",
    "steps_timed": "timed steps; with real input they stay within one epoch, so fewer when an epoch "
                   "has fewer than warmup + steps batches per process",
    "peak_pss_mb": "peak of the summed proportional set size of the training processes and their loader "
                   "workers (and compile workers), sampled every 3 s from /proc/PID/smaps_rollup",
    "steady_peak_pss_mb": "the same, over the steady-state steps only",
    "vm_hwm_mb_per_rank": "each training process's own peak resident memory (VmHWM), loader workers "
                          "not included",
    "warmup_excess_seconds": "time of the warm-up steps beyond steady steps (torch.compile's compile time)",
    "vs_seed": "ratio of medians to the seed's at the same world size and input",
    "vs_seed_paired": "median over repetitions of the ratio to the seed measured in the same repetition",
}


@dataclasses.dataclass(frozen=True)
class Job:
    """One measurement: a configuration, a world size and an input, in fresh processes."""

    config: str
    world_size: int
    input: str  # "synthetic" or "real" (which also times the loader alone)
    plan: Plan
    split: DataSplit
    steps: int
    warmup: int
    result_path: str
    start_method: str  # how this platform starts loader workers in a process started from a shell


@dataclasses.dataclass
class Trainer:
    """A configuration ready to train: `train(batches)` runs its own loop over them."""

    train: Callable[[Iterable], Any]
    memory_format: torch.memory_format
    loader: DataLoader | None
    set_epoch: Callable[[int], None]


def build_trainer(job: Job, ctx: DistContext) -> Trainer:
    """The job's configuration, built in this process: its model, optimizer and (real input) loader."""
    args, split = job.plan.args, job.split
    real = job.input == "real"
    if job.config == "seed":
        loader, sampler = (seed_loader(split.train, seed_transforms(args.img_size)[0], args.batch_size, ctx, train=True)
                           if real else (None, None))
        model, optimizer = seed_model_and_optimizer(len(split.class_names), args.seed, ctx)
        return Trainer(lambda batches: seed_train_one_epoch(model, optimizer, batches, ctx, 1), torch.contiguous_format,
                       loader, sampler.set_epoch if sampler else _no_epoch)

    # Ours, assembled as the launchers assemble it.
    loader, sampler = ours_loader(job.plan, split, ctx) if real else (None, None)
    torch.manual_seed(args.seed)
    model = model_for(args, len(split.class_names))
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
    model.to(ctx.device, memory_format=memory_format)
    amp_dtype = autocast_dtype(args.amp, ctx.device)  # the launchers' job_precision, without its line
    if args.sync_bn and ctx.distributed:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model) if ctx.device.type == "cuda" else cpu_sync_batchnorm(model)
    if ctx.device.type == "cuda":  # cuDNN's autotuning; before the wrap, a CUDA graph's side stream
        extras.prepare_gpu(args, ctx)
    wrapped = DDP(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None) \
        if ctx.distributed else model
    if args.compile:
        wrapped = torch.compile(wrapped)
    optimizer, scaler = build_optimizer(model, args, amp_dtype)
    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)
    extra = Extras()
    if args.ema or args.mixup_alpha or args.cutmix_alpha or args.bn_recalibrate or ctx.device.type == "cuda":
        extra = extras.training_extras(wrapped, model, optimizer, split, args, ctx)  # and a CUDA graph
    # The schedule's length: the epoch an epoch of this many batches would be (its shape only).
    progress = Progress(last_epoch=1)
    return Trainer(lambda batches: train_one_epoch(wrapped, criterion, optimizer, scaler, batches, 1, progress,
                                                   amp_dtype, args, ctx, extra),
                   memory_format, loader, sampler.set_epoch if sampler else _no_epoch)


def ours_loader(plan: Plan, split: DataSplit, ctx: DistContext) -> tuple[Iterable, DistributedSampler]:
    """The training loader as the launchers build it, and its DistributedSampler."""
    args = plan.args
    train_set, val_set = train_and_val_sets(split, args)
    if args.cache or args.device_augment:  # the pictures decoded once
        train_set, val_set = extras.decoded_once(split, train_set, val_set, args, ctx)
    sampler = DistributedSampler(train_set, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True, seed=args.seed)
    options = loader_options(args, ctx)
    loader = DataLoader(train_set, sampler=EpochKeys(sampler), **options, drop_last=len(sampler) > args.batch_size)
    if args.device_augment:  # each batch cropped on the device (the validation loader is built, never drawn)
        val_loader = DataLoader(val_set, sampler=ShardSampler(len(val_set), ctx), **options)
        loader, _ = extras.device_loaders(loader, val_loader, args, ctx)
    return loader, sampler


def _no_epoch(epoch: int) -> None:
    pass


def synthetic_batches(job: Job, ctx: DistContext, memory_format: torch.memory_format) -> Iterator:
    """One random batch, already on the device in the model's layout, served forever: floats
    for the seed (its workers normalise), uint8 pixels for ours (normalised in the step)."""
    args = job.plan.args
    generator = torch.Generator().manual_seed(ctx.rank)
    shape = (args.batch_size, 3, args.img_size, args.img_size)
    if job.config == "seed":
        images = torch.randn(shape, generator=generator)
    else:
        images = torch.randint(256, shape, generator=generator, dtype=torch.uint8)
    labels = torch.randint(len(job.split.class_names), (args.batch_size,), generator=generator)
    batch = (images.to(ctx.device).contiguous(memory_format=memory_format), labels.to(ctx.device))
    return itertools.repeat(batch)


def _epoch_of(trainer: Trainer, epoch: int) -> DataLoader:
    trainer.set_epoch(epoch)
    return trainer.loader


def measure(job: Job, ctx: DistContext) -> dict[str, Any]:
    """Time one configuration in this process; the numbers of this rank only."""
    started = time.perf_counter()
    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(ctx.device)
    trainer = build_trainer(job, ctx)
    out: dict[str, Any] = {"setup_seconds": time.perf_counter() - started}
    count = job.warmup + job.steps
    if job.input == "real":
        # Timed steps stay inside one epoch, so that every configuration's figure is its
        # steady state; what an epoch's start costs (the seed starts new workers every epoch,
        # ours refills its persistent ones) is measured apart, as the first batch's wait.
        count = min(count, len(trainer.loader))
        if count <= job.warmup:
            raise UserError(f"an epoch has only {len(trainer.loader)} batches per process: lower --warmup")
        # The loader alone first (the model is built but idle), then training on the next epoch.
        loader_timer = StepTimer(_epoch_of(trainer, 1), count, torch.device("cpu"))
        for _ in loader_timer:
            pass
        out["loader_step_seconds"] = loader_timer.step_seconds()
        batches: Iterable = _epoch_of(trainer, 2)
    else:
        batches = synthetic_batches(job, ctx, trainer.memory_format)
    timer = StepTimer(batches, count, ctx.device)
    wall0, perf0 = time.time(), time.perf_counter()
    trainer.train(timer)
    out["step_seconds"] = timer.step_seconds()
    out["first_batch_seconds"] = timer.first_batch_seconds()
    # Wall-clock span of the steady state, for the memory samples taken from outside.
    out["steady_wall"] = [wall0 + timer.host_marks[job.warmup] - perf0, wall0 + timer.host_marks[-1] - perf0]
    if ctx.device.type == "cuda":
        out["device_peak_mb"] = torch.cuda.max_memory_allocated(ctx.device) / 2**20
    out["vm_hwm_mb"] = vm_hwm_mb()
    return out


@exit_on_error  # in each process mp.spawn starts: its own `error:` line (or traceback) and exit code
def _rank_main(rank: int, job: Job) -> None:
    """One process of a measurement (the target of mp.spawn)."""
    measure_rank(rank, job)


def measure_rank(rank: int, job: Job) -> None:
    """One process of a measurement: its process group, its numbers, and rank 0 writing every
    rank's. Called in this process (--launcher single), its error reaches the caller, which
    records it and measures the next configuration."""
    # A process made by mp.spawn would start its loader workers by spawning too; the seed's
    # launcher (torch.distributed.launch) and our single-process one start them as the platform does.
    multiprocessing.set_start_method(job.start_method, force=True)
    try:
        if job.world_size == 1:
            ctx = process_context(None, None)
        else:
            ctx = process_context(Ranks(rank, rank, job.world_size, job.world_size), None)
            dist.init_process_group(ctx.backend, rank=rank, world_size=job.world_size,
                                    timeout=datetime.timedelta(seconds=600),
                                    device_id=ctx.device if ctx.device.type == "cuda" else None)
        per_rank = gather_objects(measure(job, ctx), ctx)
        if ctx.is_main:
            Path(job.result_path).write_text(json.dumps({"ranks": per_rank, "device": str(ctx.device),
                                                         "threads": torch.get_num_threads()}))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _run_processes(job: Job, in_process: bool) -> MemorySampler:
    """Run the job's ranks, in fresh processes (or in this one), watching their memory."""
    if in_process:
        sampler = MemorySampler([os.getpid()])
        sampler.start()
        try:
            measure_rank(0, job)
        finally:
            sampler.stop()
        return sampler
    if job.world_size > 1:
        # A free port on loopback, and gloo kept there: inherited by the ranks.
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), GLOO_SOCKET_IFNAME="lo")
    context = mp.spawn(_rank_main, args=(job,), nprocs=job.world_size, join=False)
    sampler = MemorySampler([p.pid for p in context.processes])
    sampler.start()
    deadline = time.monotonic() + JOB_TIMEOUT_SECONDS
    try:
        while not context.join(timeout=5):
            if time.monotonic() > deadline:
                raise TimeoutError(f"still running after {JOB_TIMEOUT_SECONDS}s")
    finally:
        sampler.stop()
        end_processes(context.processes)
    return sampler


def free_port() -> int:
    """A port on loopback that no one listens on now, for a measurement's process group to meet at."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def end_processes(processes: list, grace_seconds: float = 5.0) -> None:
    """A measurement's processes, ended whatever state they are in: SIGTERM, a grace period, then
    SIGKILL, so that none outlives its measurement."""
    for p in processes:
        if p.is_alive():
            p.terminate()
    for p in processes:
        p.join(grace_seconds)
        if p.is_alive():
            p.kill()
            p.join()


def run_job(job: Job, in_process: bool) -> dict[str, Any]:
    """Run one measurement in fresh processes (or in this one) and summarise it."""
    sampler = _run_processes(job, in_process)
    result = json.loads(Path(job.result_path).read_text())
    ranks = result["ranks"]
    batch = job.plan.args.batch_size
    steady = [r["step_seconds"][job.warmup:] for r in ranks]
    record: dict[str, Any] = {
        "config": job.config, "world_size": job.world_size, "input": job.input,
        "device": result["device"], "threads_per_process": result["threads"],
        "images_per_sec": sum(rank_rate(r["step_seconds"], job.warmup, batch) for r in ranks),
        "median_step_seconds": statistics.median(s for rank in steady for s in rank),
        "first_step_seconds": max(r["step_seconds"][0] for r in ranks),
        # What the warm-up steps cost beyond steady steps: torch.compile's compile time, mostly.
        "warmup_excess_seconds": max(
            sum(r["step_seconds"][:job.warmup]) - job.warmup * statistics.median(r["step_seconds"][job.warmup:])
            for r in ranks),
        "setup_seconds": max(r["setup_seconds"] for r in ranks),
        "first_batch_seconds": max(r["first_batch_seconds"] for r in ranks),
        "steps_timed": len(steady[0]),
        "step_seconds": [r["step_seconds"] for r in ranks],
        "vm_hwm_mb_per_rank": [round(r["vm_hwm_mb"], 1) for r in ranks],
    }
    if not in_process:
        span = (max(r["steady_wall"][0] for r in ranks), min(r["steady_wall"][1] for r in ranks))
        record["peak_pss_mb"] = sampler.peak()
        record["steady_peak_pss_mb"] = sampler.peak(span)
        record["memory_samples"] = len(sampler.samples)
        record["memory_sampler_cpu_seconds"] = round(sampler.cpu_seconds, 2)
    if "device_peak_mb" in ranks[0]:
        record["device_peak_mb"] = round(sum(r["device_peak_mb"] for r in ranks), 1)
    if job.input == "real":
        record["loader_images_per_sec"] = sum(rank_rate(r["loader_step_seconds"], job.warmup, batch) for r in ranks)
        record["loader_step_seconds"] = [r["loader_step_seconds"] for r in ranks]
    return record


def _what_to_measure(args: argparse.Namespace) -> tuple[list[str], dict[str, set[int]], list[int], list[dict]]:
    """The inputs, each runnable configuration's world sizes, all world sizes, and what is skipped and why."""
    inputs = [kind for kind, on in (("synthetic", args.synthetic), ("real", args.real)) if on]
    if not inputs:
        raise UserError("nothing to measure: --no-synthetic and --no-real together")
    if args.steps < 1 or args.warmup < 0 or args.repeats < 1:
        raise UserError("--steps and --repeats must be at least 1, --warmup at least 0")
    # Each configuration's world sizes: --world-sizes, or N alone for NAME@N.
    sizes_of: dict[str, set[int]] = {}
    for name, only in args.configs:
        sizes_of.setdefault(name, set()).update(args.world_sizes if only is None else [only])
    skipped: list[dict[str, Any]] = []
    for config in list(sizes_of):
        reason = missing_option(config)
        if reason:
            print(f"skipping {config}: {reason}", flush=True)
            skipped.append({"config": config, "reason": reason})
            del sizes_of[config]
    gpus = torch.cuda.device_count()
    world_sizes = []
    for ws in sorted(set().union(*sizes_of.values())):
        if gpus and ws > gpus:
            print(f"skipping world size {ws}: only {gpus} GPU(s)", flush=True)
            skipped.append({"world_size": ws, "reason": f"only {gpus} GPU(s)"})
        else:
            world_sizes.append(ws)
    if not sizes_of:
        raise UserError("no configuration left to measure")
    if args.launcher == "single" and any(ws > 1 for ws in world_sizes):
        raise UserError("--launcher single runs one process: measure world size 1 only, or use --launcher spawn")
    return inputs, sizes_of, world_sizes, skipped


def _print_record(record: dict[str, Any], repeats: int) -> None:
    loader = f", loader alone {record['loader_images_per_sec']:.1f} img/s" if "loader_images_per_sec" in record else ""
    print(f"[{record['repeat']}/{repeats}] {record['config']:13s} x{record['world_size']} {record['input']:9s} "
          f"{record['images_per_sec']:7.1f} img/s{loader}, memory {record.get('peak_pss_mb')} MiB, "
          f"first step {record['first_step_seconds']:.1f}s, run {record['wall_seconds']:.0f}s", flush=True)


def _measure_interleaved(args: argparse.Namespace, plans: dict[str, Plan], split: DataSplit, inputs: list[str],
                         sizes_of: dict[str, set[int]], world_sizes: list[int],
                         measured: Callable[[list[dict[str, Any]]], None]) -> list[dict[str, Any]]:
    """Every measurement, each in fresh processes, interleaved over the repetitions; `measured`
    is given the list after each one."""
    start_method = multiprocessing.get_start_method()
    order = [(kind, ws, c) for kind in inputs for ws in world_sizes for c in plans
             if ws in sizes_of[c] and not (kind == "synthetic" and c in SAME_SYNTHETIC_AS_OURS)]
    measurements = []
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            # A B C, then C B A: drift within a repetition does not favour whoever runs first.
            for kind, ws, config in (order if repeat % 2 == 0 else order[::-1]):
                job = Job(config, ws, kind, plans[config], split, args.steps, args.warmup,
                          str(Path(tmp) / f"{repeat}-{kind}-{ws}-{config}.json"), start_method)
                load = os.getloadavg()
                t0 = time.perf_counter()
                try:
                    record = run_job(job, in_process=args.launcher == "single")
                except Exception as e:  # noqa: BLE001 (one failing configuration must not lose the others' numbers)
                    record = {"config": config, "world_size": ws, "input": kind, "error": f"{type(e).__name__}: {e}"}
                    print(f"error: {config} x{ws} {kind}: {record['error']}", file=sys.stderr, flush=True)
                record.update(repeat=repeat + 1, load_average=load, wall_seconds=round(time.perf_counter() - t0, 1))
                measurements.append(record)
                if "error" not in record:
                    _print_record(record, args.repeats)
                measured(measurements)
    return measurements


def throughput(args: argparse.Namespace) -> dict[str, Any]:
    """The `throughput` command: every measurement, their summary, JSON, PNG and a markdown table."""
    run = Run("throughput", args.machine)
    inputs, sizes_of, world_sizes, skipped = _what_to_measure(args)
    configs = list(sizes_of)
    with data_of_size(args.data_path, args.images) as (data_path, _):
        # The image list and the split once, here; every measurement gets the same.
        plans = {c: ours_plan(data_path, args.img_size, args.batch_size, OURS_OPTIONS.get(c, [])) for c in configs}
        # Every image decoded once here, and any that does not decode left out: no measurement stops on one.
        split = readable_split(next(iter(plans.values())), DistContext.single())
        print(f"{len(split.train)} training images, {len(split.class_names)} classes; configs {configs}, "
              f"world sizes {world_sizes}, inputs {inputs}, {args.repeats} repetition(s)", flush=True)
        settings = {
            "data_path": args.data_path, "images": args.images, "train_images": len(split.train),
            "classes": len(split.class_names), "img_size": args.img_size, "batch_size_per_process": args.batch_size,
            "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats, "launcher": args.launcher,
            "configs": {c: sorted(sizes_of[c]) for c in configs},
            "world_sizes": world_sizes, "inputs": inputs,
            "ours_options": {c: vars(plans[c].args) for c in configs if c != "seed"},
        }

        def result_of(measurements: list[dict[str, Any]]) -> dict[str, Any]:
            return run.result(settings, definitions=DEFINITIONS, started_at=True, skipped=skipped,
                              summary=summarise(measurements, len(split.train)), measurements=measurements)

        def keep(measurements: list[dict[str, Any]]) -> None:  # a time limit then loses one measurement at most
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result_of(measurements), indent=1) + "\n")

        measurements = _measure_interleaved(args, plans, split, inputs, sizes_of, world_sizes, keep)
    result = result_of(measurements)
    write_result(result, args.out, throughput_table(result), plot_throughput)
    return result
