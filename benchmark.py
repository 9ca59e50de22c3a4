"""Measure this project against the recipe it started from: training speed, the data path, accuracy.

    # training images/s: seed vs ours (and torch.compile, --cache), 1 and 2 processes,
    # real JPEGs and synthetic input, interleaved over 3 repetitions; JSON + PNG
    python benchmark.py throughput --data-path DATA --world-sizes 1 2 \\
        --configs seed ours ours-compile@1 ours-cache --out docs/benchmark/cpu-throughput.json

    # images/s of each decode + transform path, one process
    python benchmark.py data --data-path DATA --out docs/benchmark/cpu-data.json

    # validation accuracy of the seed recipe and of ours (run through train_single_gpu.py)
    python benchmark.py accuracy --data-path DATA --img-size 128 --epochs 20 --out docs/benchmark/accuracy.json

These are the commands behind the results in docs/benchmark/, where DATA is a folder of real
photos, one sub-folder per class (the README's Performance section names the one used).

"seed" is the recipe of WZMIAOMIAO's train_multi_GPU that this project grew from: fp32, NCHW,
PIL + torchvision.transforms v1, SGD(lr=0.001 x processes, momentum 0.9, weight decay 5e-3 on
every parameter), a cosine schedule stepped per epoch, and a host sync (`loss.item()`) plus a
loss all-reduce at every step. "ours" is this project's defaults, assembled from its own functions.
Both use the project's split and ResNet34, so only the recipe differs.

How the throughput is measured, and why:
- every measurement runs in fresh processes started with torch.multiprocessing (as the spawn
  launcher does), so peak memory belongs to that configuration alone; world size N is N DDP
  processes (gloo on the CPU, each with its share of the cores), rank 0 collecting;
- configurations are interleaved (A B C, then C B A, ...) and each figure is the median over
  repetitions, so slow drift in the machine's other load touches every configuration alike;
- a step is timed from taking one batch to taking the next (CUDA events on a GPU): the loop's
  own work plus any wait for data; warm-up steps, which include torch.compile, are excluded.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import math
import multiprocessing
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import PIL
import torch
import torch.multiprocessing as mp
import torchvision
from PIL import Image
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import BatchSampler, DataLoader, Dataset, DistributedSampler
from torchvision import transforms as v1
from torchvision.io import ImageReadMode, decode_jpeg, read_file
from torchvision.transforms import v2

from model import create_model
from multi_train_utils.config import BoolFlag, Plan, get_args_parser, prepare
from multi_train_utils.distributed_utils import (
    DistContext,
    all_reduce_sum,
    cpu_count,
    gather_objects,
    host_store,
    keep_gloo_on_loopback,
    setup_process_group,
    setup_single,
    stop,
    teardown,
)
from multi_train_utils.train_eval_utils import (
    build_loaders,
    build_training,
    evaluate,
    peak_lr,
    place_model,
    readable_split,
)
from my_dataset import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    build_transform,
    decode,
    eval_resize,
    normalize,
)
from plots import figure_class, read_metrics
from utils import (
    DataSplit,
    Sample,
    TrainingDiverged,
    UserError,
    exit_on_error,
    list_images,
    load_rgb,
)

ROOT = Path(__file__).resolve().parent

# The seed recipe's hyper-parameters (train_multi_gpu_using_launch.py of the original repository).
SEED_LR = 0.001  # multiplied by the number of processes, as the seed did
SEED_LRF = 0.1
SEED_MOMENTUM = 0.9
SEED_WEIGHT_DECAY = 5e-3

# Project options that turn each of our configurations on; `ours` is the defaults as they are.
OURS_OPTIONS = {"ours": [], "ours-compile": ["--compile"], "ours-cache": ["--cache"]}
CONFIGS = ("seed", *OURS_OPTIONS)
# Configurations whose synthetic-input figure is ours' (the option only changes the loader),
# and whose loader is ours' (the option only changes the model).
SAME_SYNTHETIC_AS_OURS = {"ours-cache"}
SAME_LOADER_AS_OURS = {"ours-compile"}
# Reading a process's PSS walks its page tables: ~30 ms for a 1.5 GB training process here. Every
# 3 s keeps the sampler's CPU time near 1% of one core, so it does not slow what it watches.
MEMORY_SAMPLE_SECONDS = 3.0
JOB_TIMEOUT_SECONDS = 1200  # one measurement; a hung process group must not stall the whole benchmark


# --------------------------------------------------------------------------- the seed recipe

def seed_transforms(img_size: int) -> tuple[v1.Compose, v1.Compose]:
    """The seed's v1 transforms, with its 224/256 sizes scaled to `img_size`."""
    normalize = v1.Normalize(IMAGENET_MEAN, IMAGENET_STD)
    train = v1.Compose([v1.RandomResizedCrop(img_size), v1.RandomHorizontalFlip(), v1.ToTensor(), normalize])
    val = v1.Compose([v1.Resize(eval_resize(img_size)), v1.CenterCrop(img_size), v1.ToTensor(), normalize])
    return train, val


class SeedDataSet(Dataset):
    """The seed's MyDataSet: every access opens the JPEG with PIL and decodes it at full size."""

    def __init__(self, samples: list[Sample], transform: v1.Compose):
        self.samples = samples
        self.transform = transform

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        path, label = self.samples[index]
        img = Image.open(path)
        if img.mode != "RGB":  # the seed raised here; converting keeps odd files from ending a benchmark
            img = img.convert("RGB")
        return self.transform(img), label


def seed_loader(samples: list[Sample], transform: v1.Compose, batch_size: int, ctx: DistContext,
                train: bool) -> tuple[DataLoader, DistributedSampler]:
    """The seed's loader: a DistributedSampler (shuffling, seed 0) in every process,
    min(CPUs, batch, 8) workers per process, pinned memory, full batches only when training."""
    warnings.filterwarnings("ignore", message=".*pin_memory.*")  # pinning without a GPU is a no-op
    dataset = SeedDataSet(samples, transform)
    sampler = DistributedSampler(dataset, num_replicas=ctx.world_size, rank=ctx.rank)
    workers = min(os.cpu_count() or 1, batch_size if batch_size > 1 else 0, 8)
    if train:
        loader = DataLoader(dataset, batch_sampler=BatchSampler(sampler, batch_size, drop_last=True),
                            pin_memory=True, num_workers=workers)
    else:
        loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, pin_memory=True, num_workers=workers)
    return loader, sampler


def seed_model_and_optimizer(num_classes: int, seed: int, ctx: DistContext) -> tuple[nn.Module, torch.optim.SGD]:
    torch.manual_seed(seed)  # the same initial weights as ours (the seed broadcast rank 0's through a file)
    model = create_model(num_classes).to(ctx.device)
    if ctx.distributed:
        model = DDP(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=SEED_LR * ctx.world_size, momentum=SEED_MOMENTUM,
                                weight_decay=SEED_WEIGHT_DECAY)
    return model, optimizer


def seed_train_one_epoch(model: nn.Module, optimizer: torch.optim.Optimizer, loader: Iterable,
                         ctx: DistContext, epoch: int) -> float:
    """The seed's train_one_epoch: fp32, NCHW; every step all-reduces the loss, and the host
    waits for it twice (the progress bar's mean loss on rank 0, the finiteness check everywhere)."""
    model.train()
    loss_function = nn.CrossEntropyLoss()
    mean_loss = torch.zeros(1, device=ctx.device)
    optimizer.zero_grad()
    bar = _seed_bar(loader, ctx)
    for step, (images, labels) in enumerate(bar):
        pred = model(images.to(ctx.device))
        loss = loss_function(pred, labels.to(ctx.device))
        loss.backward()
        loss = all_reduce_sum(loss.detach().clone(), ctx) / ctx.world_size
        mean_loss = (mean_loss * step + loss) / (step + 1)
        if ctx.is_main:
            bar.desc = f"[epoch {epoch}] mean loss {round(mean_loss.item(), 3)}"
        if not torch.isfinite(loss):
            raise TrainingDiverged(f"seed recipe: non-finite loss at epoch {epoch}, step {step}")
        optimizer.step()
        optimizer.zero_grad()
    return mean_loss.item()


def _seed_bar(loader: Iterable, ctx: DistContext) -> Any:
    from tqdm import tqdm

    # disable=None: a bar on a terminal only, as in the project's loop, so logs stay clean.
    return tqdm(loader, disable=None if ctx.is_main else True, leave=False)


# --------------------------------------------------------------------------- configurations

def ours_args(data_path: str, img_size: int, batch_size: int, options: list[str]) -> argparse.Namespace:
    """The project's defaults, parsed by the project's own parser, plus `options`."""
    parser = get_args_parser("benchmark")
    base = ["--data-path", data_path, "--img-size", str(img_size), "--batch-size", str(batch_size)]
    return parser.parse_args(base + options)


def missing_option(config: str) -> str | None:
    """Why `config` cannot run with this checkout's options, or None."""
    _, unknown = get_args_parser("benchmark").parse_known_args(OURS_OPTIONS.get(config, []))
    return f"this checkout has no {' '.join(unknown)} option" if unknown else None


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
    args, split = job.plan.args, job.split
    real = job.input == "real"
    if job.config == "seed":
        loader, sampler = (seed_loader(split.train, seed_transforms(args.img_size)[0], args.batch_size, ctx, train=True)
                           if real else (None, None))
        model, optimizer = seed_model_and_optimizer(len(split.class_names), args.seed, ctx)
        return Trainer(lambda batches: seed_train_one_epoch(model, optimizer, batches, ctx, 1), torch.contiguous_format,
                       loader, sampler.set_epoch if sampler else _no_epoch)

    # Ours, assembled by the same functions as multi_train_utils.train_eval_utils.run.
    loader = build_loaders(split, job.plan, ctx)[0] if real else None
    torch.manual_seed(args.seed)
    model = create_model(len(split.class_names))
    memory_format, amp_dtype = place_model(model, args, ctx)
    steps_per_epoch = max(1, len(split.train) // (args.batch_size * ctx.world_size))
    training = build_training(model, args, ctx, peak_lr(args, ctx), steps_per_epoch, memory_format, amp_dtype)
    return Trainer(lambda batches: training.train_one_epoch(batches, ctx, 1, 1), memory_format, loader,
                   loader.sampler.set_epoch if loader else _no_epoch)


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


def epoch_of(trainer: Trainer, epoch: int) -> DataLoader:
    trainer.set_epoch(epoch)
    return trainer.loader


# --------------------------------------------------------------------------- timing one process

class StepTimer:
    """Hands `count` batches to a training loop and times each step: from taking one batch to
    taking the next, so a step is the loop's own work plus any wait for the loader. On CUDA the
    marks are events, so the times are the device's and the loop needs no extra sync."""

    def __init__(self, batches: Iterable, count: int, device: torch.device):
        self.batches = batches
        self.count = count
        self.cuda = device.type == "cuda"
        self.host_marks: list[float] = []
        self.events: list[torch.cuda.Event] = []
        self.requested = 0.0

    def __len__(self) -> int:
        return self.count  # train_one_epoch reads it for its last-step check and progress bar

    def __iter__(self) -> Iterator:
        self.requested = time.perf_counter()  # before iter(loader): an epoch's start-up counts from here
        for _, batch in zip(range(self.count), self.batches):
            self._mark()
            yield batch
        self._mark()

    def first_batch_seconds(self) -> float:
        """From asking for the batches to having the first: starting (or refilling) the loader workers."""
        return self.host_marks[0] - self.requested

    def _mark(self) -> None:
        self.host_marks.append(time.perf_counter())
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.events.append(event)

    def step_seconds(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) / 1000 for a, b in itertools.pairwise(self.events)]
        return [b - a for a, b in itertools.pairwise(self.host_marks)]


def rank_rate(step_seconds: list[float], warmup: int, batch_size: int) -> float:
    steady = step_seconds[warmup:]
    return batch_size * len(steady) / sum(steady)


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
        loader_timer = StepTimer(epoch_of(trainer, 1), count, torch.device("cpu"))
        for _ in loader_timer:
            pass
        out["loader_step_seconds"] = loader_timer.step_seconds()
        batches: Iterable = epoch_of(trainer, 2)
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
    # The kernel's high-water mark of this process's resident memory (getrusage's ru_maxrss
    # would also count the parent's memory at the moment it started this process).
    status = Path("/proc/self/status").read_text()
    out["vm_hwm_mb"] = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:")) / 1024
    return out


def _rank_main(rank: int, job: Job, store_address: tuple[str, int] | None) -> None:
    """One process of a measurement (the target of mp.spawn)."""
    # A process made by mp.spawn would start its loader workers by spawning too; the seed's
    # launcher (torch.distributed.launch) and our single-process one start them as the platform does.
    multiprocessing.set_start_method(job.start_method, force=True)
    with exit_on_error():
        try:
            if job.world_size == 1:
                ctx = setup_single(None)
            else:
                ctx = setup_process_group(rank, rank, job.world_size, job.world_size, None, None, 600, store_address)
            per_rank = gather_objects(measure(job, ctx), ctx)
            if ctx.is_main:
                Path(job.result_path).write_text(json.dumps({"ranks": per_rank, "device": str(ctx.device),
                                                             "threads": torch.get_num_threads()}))
        finally:
            teardown()


# --------------------------------------------------------------------------- memory from outside

def _children_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                stat = Path(entry.path, "stat").read_text()
                ppid = int(stat.rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry.name))
    return children


def _pss_mb(pid: int) -> float:
    """Proportional set size: shared pages (libraries, copy-on-write memory of forked loader
    workers, the shared-memory cache) are split among the processes that map them, so a sum
    over processes counts each page once."""
    with contextlib.suppress(OSError, ValueError, StopIteration), open(f"/proc/{pid}/smaps_rollup") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Pss:")) / 1024
    return 0.0


class MemorySampler(threading.Thread):
    """Samples the summed PSS of some processes and all their descendants (loader workers)."""

    def __init__(self, roots: list[int]):
        super().__init__(daemon=True)
        self.roots = roots
        self.samples: list[tuple[float, float]] = []  # (time.time(), MiB)
        self.done = threading.Event()
        self.cpu_seconds = 0.0

    def run(self) -> None:
        wait = 1.0  # a first look soon, so that even a short run has one
        while not self.done.wait(wait):
            wait = MEMORY_SAMPLE_SECONDS
            started = time.thread_time()
            children = _children_map()
            tree, todo = [], list(self.roots)
            while todo:
                pid = todo.pop()
                tree.append(pid)
                todo.extend(children.get(pid, []))
            self.samples.append((time.time(), sum(_pss_mb(p) for p in tree)))
            self.cpu_seconds += time.thread_time() - started

    def stop(self) -> None:
        self.done.set()
        self.join()

    def peak(self, span: tuple[float, float] | None = None) -> float | None:
        values = [mb for t, mb in self.samples if span is None or span[0] <= t <= span[1]]
        return round(max(values), 1) if values else None


def run_job(job: Job, in_process: bool) -> dict[str, Any]:
    """Run one measurement in fresh processes (or in this one) and summarise it."""
    if in_process:
        sampler = MemorySampler([os.getpid()])
        sampler.start()
        try:
            _rank_main(0, job, None)
        finally:
            sampler.stop()
    else:
        store_address = None
        if job.world_size > 1:
            store = host_store("127.0.0.1", 0, 600)
            store_address = ("127.0.0.1", store.port)
            keep_gloo_on_loopback("127.0.0.1")  # inherited by the spawned ranks
        context = mp.spawn(_rank_main, args=(job, store_address), nprocs=job.world_size, join=False)
        sampler = MemorySampler([p.pid for p in context.processes])
        sampler.start()
        deadline = time.monotonic() + JOB_TIMEOUT_SECONDS
        try:
            while not context.join(timeout=5):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"still running after {JOB_TIMEOUT_SECONDS}s")
        finally:
            sampler.stop()
            stop(context.processes)
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


# --------------------------------------------------------------------------- throughput

def throughput(args: argparse.Namespace) -> dict[str, Any]:
    started = time.time()
    load_start = os.getloadavg()
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
    configs = list(sizes_of)
    gpus = torch.cuda.device_count()
    world_sizes = []
    for ws in sorted(set().union(*sizes_of.values())):
        if gpus and ws > gpus:
            print(f"skipping world size {ws}: only {gpus} GPU(s)", flush=True)
            skipped.append({"world_size": ws, "reason": f"only {gpus} GPU(s)"})
        else:
            world_sizes.append(ws)
    if not configs:
        raise UserError("no configuration left to measure")
    if args.launcher == "single" and any(ws > 1 for ws in world_sizes):
        raise UserError("--launcher single runs one process: measure world size 1 only, or use --launcher spawn")

    # The image list and the split once, here; every measurement gets the same.
    plans = {c: prepare(ours_args(args.data_path, args.img_size, args.batch_size, OURS_OPTIONS.get(c, [])),
                        "benchmark", verbose=False) for c in configs}
    split = readable_split(next(iter(plans.values())), DistContext.single())
    print(f"{len(split.train)} training images, {len(split.class_names)} classes; configs {configs}, "
          f"world sizes {world_sizes}, inputs {inputs}, {args.repeats} repetition(s)", flush=True)

    start_method = multiprocessing.get_start_method()
    order = [(kind, ws, c) for kind in inputs for ws in world_sizes for c in configs
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
                    loader = (f", loader alone {record['loader_images_per_sec']:.1f} img/s"
                              if "loader_images_per_sec" in record else "")
                    print(f"[{repeat + 1}/{args.repeats}] {config:13s} x{ws} {kind:9s} "
                          f"{record['images_per_sec']:7.1f} img/s{loader}, memory {record.get('peak_pss_mb')} MiB, "
                          f"first step {record['first_step_seconds']:.1f}s, run {record['wall_seconds']:.0f}s",
                          flush=True)

    result = {
        "benchmark": "throughput",
        "command": command_line(),
        "machine": machine_info(args.machine),
        "settings": {
            "data_path": args.data_path, "train_images": len(split.train), "classes": len(split.class_names),
            "img_size": args.img_size, "batch_size_per_process": args.batch_size, "steps": args.steps,
            "warmup": args.warmup, "repeats": args.repeats, "launcher": args.launcher,
            "configs": {c: sorted(sizes_of[c]) for c in configs},
            "world_sizes": world_sizes, "inputs": inputs,
            "ours_options": {c: vars(plans[c].args) for c in configs if c != "seed"},
        },
        "definitions": {
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
        },
        "load_average": {"start": load_start, "end": os.getloadavg()},
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "wall_seconds": round(time.time() - started, 1),
        "skipped": skipped,
        "summary": summarise(measurements, len(split.train)),
        "measurements": measurements,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    plot_throughput(result, out.with_suffix(".png"))
    print(throughput_table(result))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return result


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarise(measurements: list[dict[str, Any]], train_images: int) -> list[dict[str, Any]]:
    ok = [m for m in measurements if "error" not in m]
    keys = list(dict.fromkeys((m["config"], m["world_size"], m["input"]) for m in measurements))

    def of(config: str, ws: int, kind: str) -> list[dict[str, Any]]:
        return [m for m in ok if (m["config"], m["world_size"], m["input"]) == (config, ws, kind)]

    rows = []
    for config, ws, kind in keys:
        runs = of(config, ws, kind)
        rates = [m["images_per_sec"] for m in runs]
        row: dict[str, Any] = {"config": config, "world_size": ws, "input": kind, "repeats": len(runs),
                               "failed": sum(1 for m in measurements if "error" in m and
                                             (m["config"], m["world_size"], m["input"]) == (config, ws, kind))}
        if runs:
            rate = _median(rates)
            seed_runs = {m["repeat"]: m["images_per_sec"] for m in of("seed", ws, kind)}
            row.update(
                images_per_sec=round(rate, 2),
                images_per_sec_all=[round(r, 2) for r in rates],
                median_step_seconds=round(_median([m["median_step_seconds"] for m in runs]), 4),
                epoch_seconds_extrapolated=round(train_images / rate + _median([m["first_batch_seconds"] for m in runs]),
                                                 1),
                first_batch_seconds=round(_median([m["first_batch_seconds"] for m in runs]), 2),
                steps_timed=runs[0]["steps_timed"],
                first_step_seconds=round(_median([m["first_step_seconds"] for m in runs]), 2),
                warmup_excess_seconds=round(_median([m["warmup_excess_seconds"] for m in runs]), 2),
                setup_seconds=round(_median([m["setup_seconds"] for m in runs]), 2),
            )
            for key in ("peak_pss_mb", "steady_peak_pss_mb", "device_peak_mb"):
                values = [m[key] for m in runs if m.get(key) is not None]
                if values:
                    row[key] = round(_median(values), 1)
            if kind == "real":
                row["loader_images_per_sec"] = round(_median([m["loader_images_per_sec"] for m in runs]), 2)
            if seed_runs and config != "seed":
                row["vs_seed"] = round(rate / _median(list(seed_runs.values())), 3)
                paired = [m["images_per_sec"] / seed_runs[m["repeat"]] for m in runs if m["repeat"] in seed_runs]
                row["vs_seed_paired"] = round(_median(paired), 3) if paired else None
        rows.append(row)
    return rows


def _group_order(group: tuple[str, int]) -> tuple[int, int]:
    config, ws = group
    return ws, CONFIGS.index(config)


def throughput_table(result: dict[str, Any]) -> str:
    """The summary as a markdown table: one row per configuration and world size; ratios are
    to the seed at the same world size and input."""
    rows = {(r["config"], r["world_size"], r["input"]): r for r in result["summary"]}
    header = ("| config | processes | synthetic img/s (vs seed) | real img/s (vs seed) | loader alone img/s | "
              "epoch s (extrapolated) | peak memory MiB (real) | compile s |")
    lines = [header, "|---|---|---|---|---|---|---|---|"]

    def rate(row: dict[str, Any]) -> str:
        if "images_per_sec" not in row:
            return "–"
        ratio = 1.0 if row["config"] == "seed" else row.get("vs_seed")
        return f"{row['images_per_sec']:.1f}" + (f" ({ratio:.2f}x)" if ratio is not None else "")

    def fmt(value: float | None, spec: str = ".1f") -> str:
        return "–" if value is None else f"{value:{spec}}"

    for config, ws in sorted(dict.fromkeys((c, w) for c, w, _ in rows), key=_group_order):
        syn = rows.get((config, ws, "synthetic")) or (rows.get(("ours", ws, "synthetic"))
                                                      if config in SAME_SYNTHETIC_AS_OURS else None) or {}
        real = rows.get((config, ws, "real"), {})
        loader = real.get("loader_images_per_sec")
        if loader is None and config in SAME_LOADER_AS_OURS:
            loader = rows.get(("ours", ws, "real"), {}).get("loader_images_per_sec")
        compile_s = real.get("warmup_excess_seconds", syn.get("warmup_excess_seconds")) if "compile" in config else None
        lines.append(
            f"| {config} | {ws} | {rate(syn)} | {rate(real)} | {fmt(loader)} | "
            f"{fmt(real.get('epoch_seconds_extrapolated'))} | {fmt(real.get('peak_pss_mb'), '.0f')} | "
            f"{fmt(compile_s, '.0f')} |"
        )
    return "\n".join(lines)


def plot_throughput(result: dict[str, Any], path: Path) -> None:
    """Training images/s per configuration and world size, synthetic next to real, with the
    loader alone as a tick: where the tick is below a real bar's top, data loading limits it."""
    Figure = figure_class()
    if Figure is None:
        print("matplotlib is not installed: no plot")
        return
    rows = {(r["config"], r["world_size"], r["input"]): r for r in result["summary"] if "images_per_sec" in r}
    groups = sorted(dict.fromkeys((c, w) for c, w, _ in rows), key=_group_order)
    fig = Figure(figsize=(max(6.5, 1.35 * len(groups) + 2), 4.8), layout="constrained")
    ax = fig.subplots()
    width = 0.38
    # A loader far faster than training (tiny images, the cache) would flatten the bars: clip its tick.
    top = 1.3 * max(r["images_per_sec"] for r in rows.values())
    for i, (config, ws) in enumerate(groups):
        for offset, kind, style in ((-width / 2, "synthetic", {"color": "#9ecae1", "hatch": "//"}),
                                    (width / 2, "real", {"color": "#3182bd"})):
            row = rows.get((config, ws, kind))
            if row is None:
                continue
            ax.bar(i + offset, row["images_per_sec"], width, edgecolor="black", linewidth=0.5, **style,
                   label=f"{kind} input" if i == 0 else None)
            label = f"{row['images_per_sec']:.1f}"
            if kind == "real" and "vs_seed" in row:
                label += f"\n{row['vs_seed']:.2f}x"
            ax.annotate(label, (i + offset, row["images_per_sec"]), ha="center", va="bottom", fontsize=8,
                        xytext=(0, 2), textcoords="offset points")
            if kind == "real" and "loader_images_per_sec" in row:
                loader = row["loader_images_per_sec"]
                ax.plot([i + offset - width / 2, i + offset + width / 2], [min(loader, top)] * 2,
                        color="tab:red", linewidth=2, label="data loader alone" if i == 0 else None)
                if loader > top:
                    ax.annotate(f"loader {loader:.0f} ↑", (i + offset, top), ha="center", va="top", fontsize=7,
                                color="tab:red", xytext=(0, -3), textcoords="offset points")
    ax.set_xticks(range(len(groups)), [f"{c}\n{w} process{'es' if w > 1 else ''}"
                                       + ("\n(synthetic: as ours)" if c in SAME_SYNTHETIC_AS_OURS else "")
                                       for c, w in groups])
    ax.set_ylabel("training images/s (median)")
    settings = result["settings"]
    ax.set_title(f"{result['machine']['name']}\n{settings['img_size']} px, batch {settings['batch_size_per_process']} "
                 f"per process, median of {settings['repeats']}; ratios: real input vs seed with as many processes",
                 fontsize=9)
    ax.set_ylim(0, 1.08 * top)
    ax.grid(axis="y", alpha=0.3)
    fig.legend(loc="outside lower center", ncols=3, fontsize=8)
    fig.savefig(path, dpi=110)


# --------------------------------------------------------------------------- data paths

def data_paths(args: argparse.Namespace) -> dict[str, Any]:
    """Images/s of each way to decode a JPEG and apply the training transform, in one process
    with one thread, as a data-loader worker runs it."""
    started = time.time()
    load_start = os.getloadavg()
    torch.set_num_threads(1)
    _, samples = list_images(args.data_path)
    step = max(1, len(samples) // args.images) if args.images else 1
    paths = [p for p, _ in samples][::step][: args.images or None]
    for p in paths:
        Path(p).read_bytes()  # into the page cache, so the first path timed does not pay for the disk
    size = args.img_size
    v2_train = build_transform(size, train=True)  # the project's: PIL to uint8 tensor first, then the geometry
    on_pil = v2.Compose([*v2_train.transforms[1:], v2.PILToTensor()])  # the same geometry, on the PIL image

    def in_worker(pixels: torch.Tensor) -> torch.Tensor:
        """What ours' workers did before normalising moved to the device: worth a row of its own."""
        return normalize(pixels.unsqueeze(0))[0]

    v1_train = seed_transforms(size)[0]

    def pil(path: str) -> Image.Image:
        with Image.open(path) as img:
            return img.convert("RGB")

    def tensor_jpeg(path: str) -> torch.Tensor:
        return decode_jpeg(read_file(path), mode=ImageReadMode.RGB, apply_exif_orientation=True)

    pipelines: dict[str, Callable[[str], Any]] = {
        "decode: PIL": pil,
        "decode: PIL draft (load_rgb)": lambda p: load_rgb(p, size),
        "decode: torchvision.io.decode_jpeg": tensor_jpeg,
        "seed: PIL + v1 on PIL + float, normalise": lambda p: v1_train(pil(p)),
        "PIL + v2 on PIL": lambda p: on_pil(pil(p)),
        "PIL + v2 on uint8 tensor": lambda p: v2_train(pil(p)),
        "PIL draft + v2 on PIL": lambda p: on_pil(load_rgb(p, size)),
        "PIL draft + v2 on uint8 tensor": lambda p: v2_train(load_rgb(p, size)),
        "decode_jpeg + v2 on uint8 tensor": lambda p: v2_train(tensor_jpeg(p)),
        "decode_jpeg + v2 on uint8 tensor + float, normalise": lambda p: in_worker(v2_train(tensor_jpeg(p))),
        "decode() + v2 on uint8 tensor (ours)": lambda p: v2_train(decode(p, size)),
    }
    times: dict[str, list[float]] = {name: [] for name in pipelines}
    for repeat in range(args.repeats):
        for name, fn in (pipelines.items() if repeat % 2 == 0 else reversed(pipelines.items())):
            torch.manual_seed(0)  # the same crops for every path
            t0 = time.perf_counter()
            for p in paths:
                fn(p)
            times[name].append(time.perf_counter() - t0)
    rows = []
    for name, secs in times.items():
        rate = len(paths) / statistics.median(secs)
        rows.append({"path": name, "images_per_sec": round(rate, 1), "ms_per_image": round(1000 / rate, 2),
                     "images_per_sec_all": [round(len(paths) / s, 1) for s in secs]})
    full = [r for r in rows if not r["path"].startswith("decode:")]
    fastest = max(full, key=lambda r: r["images_per_sec"])
    ours = next(r for r in rows if r["path"].endswith("(ours)"))
    result = {
        "benchmark": "data",
        "command": command_line(),
        "machine": machine_info(args.machine),
        "settings": {"data_path": args.data_path, "images": len(paths), "img_size": size, "repeats": args.repeats,
                     "threads": 1,
                     "transform": "RandomResizedCrop + RandomHorizontalFlip, giving uint8 pixels; rows marked "
                                  "'float, normalise' also convert and normalise in the worker, as the seed does "
                                  "(ours does it on the device, per batch)"},
        "load_average": {"start": load_start, "end": os.getloadavg()},
        "wall_seconds": round(time.time() - started, 1),
        "paths": rows,
        "fastest": fastest["path"],
        "fastest_vs_ours": round(fastest["images_per_sec"] / ours["images_per_sec"], 3),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print("| path | images/s | ms/image |\n|---|---|---|")
    for r in rows:
        print(f"| {r['path']} | {r['images_per_sec']:.1f} | {r['ms_per_image']:.2f} |")
    print(f"fastest decode + transform: {fastest['path']} ({fastest['images_per_sec']:.1f} img/s, "
          f"{result['fastest_vs_ours']:.2f}x ours)")
    print(f"wrote {out}")
    return result


# --------------------------------------------------------------------------- accuracy

def train_seed(args: argparse.Namespace, split: DataSplit, log: Callable[[str], None]) -> list[dict[str, Any]]:
    """The seed's training loop and schedule, in this process, on the project's split and model."""
    ctx = setup_single(None)
    epochs = args.epochs
    train_tf, val_tf = seed_transforms(args.img_size)
    model, optimizer = seed_model_and_optimizer(len(split.class_names), args.seed, ctx)
    train_loader, train_sampler = seed_loader(split.train, train_tf, args.batch_size, ctx, train=True)
    val_loader, _ = seed_loader(split.val, val_tf, args.batch_size, ctx, train=False)

    def cosine(x: int) -> float:  # the seed's lf, stepped once per epoch
        return ((1 + math.cos(x * math.pi / epochs)) / 2) * (1 - SEED_LRF) + SEED_LRF

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=cosine)
    records = []
    for epoch in range(epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.perf_counter()
        lr = optimizer.param_groups[0]["lr"]
        train_loss = seed_train_one_epoch(model, optimizer, train_loader, ctx, epoch)
        scheduler.step()
        train_seconds = time.perf_counter() - t0
        # At one process the project's exact evaluation counts what the seed's did: argmax hits / images.
        val = evaluate(model, val_loader, ctx)
        records.append({"epoch": epoch + 1, "train_loss": train_loss, **val, "lr": lr, "epoch_seconds": train_seconds,
                        "eval_seconds": time.perf_counter() - t0 - train_seconds})
        log(f"seed epoch {epoch + 1}/{epochs}: train loss {train_loss:.4f}, val acc {val['val_acc']:.4f}, "
            f"{train_seconds:.1f}s")
    return records


def train_ours(args: argparse.Namespace, options: list[str], out_dir: Path) -> tuple[list[dict[str, Any]], str]:
    """Our defaults (plus `options`) through the real launcher, on the settings the seed recipe
    gets; its metrics.jsonl is the result. Returns that and the command, as a user would type it."""
    cmd = ["train_single_gpu.py", "--data-path", args.data_path, "--img-size", str(args.img_size),
           "--epochs", str(args.epochs), "--batch-size", str(args.batch_size), "--seed", str(args.seed),
           "--output-dir", str(out_dir), *options]
    print("$ " + shlex.join(["python", *cmd]), flush=True)
    subprocess.run([sys.executable, *cmd], cwd=ROOT, check=True)
    return read_metrics(out_dir), shlex.join(["python", *cmd])


def recipe_summary(records: list[dict[str, Any]], wall_seconds: float, command: str) -> dict[str, Any]:
    accs = [r["val_acc"] for r in records]
    return {
        "command": command,
        "final_val_acc": accs[-1],
        "best_val_acc": max(accs),
        "last3_mean_val_acc": statistics.fmean(accs[-3:]),
        "val_acc_per_epoch": accs,
        "train_seconds": round(sum(r["epoch_seconds"] for r in records), 1),
        "eval_seconds": round(sum(r["eval_seconds"] for r in records), 1),
        "wall_seconds": round(wall_seconds, 1),
        "epochs": records,
    }


def accuracy(args: argparse.Namespace) -> dict[str, Any]:
    started = time.time()
    load_start = os.getloadavg()
    runs_dir = Path(args.runs_dir or f"runs/benchmark-accuracy-{time.strftime('%Y%m%d-%H%M%S')}")
    ours_defaults = ours_args(args.data_path, args.img_size, args.batch_size,
                              ["--epochs", str(args.epochs), "--seed", str(args.seed)])
    plan = prepare(ours_defaults, "benchmark", verbose=False)
    split = readable_split(plan, DistContext.single())
    recipes: dict[str, dict[str, Any]] = {}
    if not args.skip_seed:
        t0 = time.perf_counter()
        records = train_seed(plan.args, split, lambda line: print(line, flush=True))
        recipes["seed"] = recipe_summary(records, time.perf_counter() - t0,
                                         f"{command_line()}  (the seed recipe, in-process)")
    variants = [("ours", [])] + [(f"ours {v}", shlex.split(v)) for v in args.variant]
    for name, options in variants:
        out_dir = runs_dir / name.replace(" ", "").replace("--", "_")
        t0 = time.perf_counter()
        records, cmd = train_ours(args, options, out_dir)
        recipes[name] = recipe_summary(records, time.perf_counter() - t0, cmd)
    result: dict[str, Any] = {
        "benchmark": "accuracy",
        "command": command_line(),
        "machine": machine_info(args.machine),
        "settings": {"data_path": args.data_path, "img_size": args.img_size, "epochs": args.epochs,
                     "batch_size": args.batch_size, "val_rate": plan.args.val_rate, "seed": plan.args.seed,
                     "train_images": len(split.train), "val_images": len(split.val), "runs_dir": str(runs_dir)},
        "load_average": {"start": load_start, "end": os.getloadavg()},
        "wall_seconds": round(time.time() - started, 1),
        "recipes": recipes,
    }
    if "seed" in recipes:
        seed_acc = recipes["seed"]["final_val_acc"]
        result["points_above_seed"] = {name: round(100 * (r["final_val_acc"] - seed_acc), 2)
                                       for name, r in recipes.items() if name != "seed"}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    plot_accuracy(result, out.with_suffix(".png"))
    print("| recipe | final val acc | best | mean of last 3 | train s | wall s |\n|---|---|---|---|---|---|")
    for name, r in recipes.items():
        print(f"| {name} | {100 * r['final_val_acc']:.1f}% | {100 * r['best_val_acc']:.1f}% | "
              f"{100 * r['last3_mean_val_acc']:.1f}% | {r['train_seconds']:.0f} | {r['wall_seconds']:.0f} |")
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return result


def plot_accuracy(result: dict[str, Any], path: Path) -> None:
    Figure = figure_class()
    if Figure is None:
        print("matplotlib is not installed: no plot")
        return
    fig = Figure(figsize=(7, 4.2), layout="constrained")
    ax = fig.subplots()
    for name, r in result["recipes"].items():
        accs = r["val_acc_per_epoch"]
        ax.plot(range(1, len(accs) + 1), [100 * a for a in accs], "o-", markersize=3,
                label=f"{name}: final {100 * accs[-1]:.1f}%")
    s = result["settings"]
    ax.set(xlabel="epoch", ylabel="validation accuracy (%)",
           title=f"{s['train_images']} training / {s['val_images']} validation images, {s['img_size']} px, from scratch\n"
                 f"{result['machine']['name']}")
    ax.title.set_fontsize(9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=110)


# --------------------------------------------------------------------------- common

def command_line() -> str:
    return shlex.join(["python", *sys.argv])


def machine_info(name: str | None) -> dict[str, Any]:
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")),
                 platform.processor())
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), [])
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    info = {
        "name": name or f"{cpu_count()}-core {model}" + (f", {gpu}" if gpu else ", no GPU"),
        "cpu_model": model,
        "cpu_flags_of_note": [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags],
        "cores": os.cpu_count(),
        "usable_cores": cpu_count(),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "gpu": gpu,
        "gpus": torch.cuda.device_count(),
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "pillow": PIL.__version__,
        "python": platform.python_version(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        git = ["git", "-C", str(ROOT)]
        info["git_commit"] = subprocess.check_output([*git, "rev-parse", "HEAD"], text=True).strip()
        dirty = subprocess.check_output([*git, "status", "--porcelain", "--untracked-files=no"], text=True).split("\n")
        info["git_modified_files"] = [line[3:] for line in dirty if line.strip()]
    return info


def config_spec(text: str) -> tuple[str, int | None]:
    name, _, size = text.partition("@")
    if name not in CONFIGS or (size and not size.isdigit()):
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME or NAME@N with NAME one of {', '.join(CONFIGS)}")
    return name, int(size) if size else None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser, out: str, img_size: int) -> None:
        p.add_argument("--data-path", required=True, help="one sub-folder of real photos per class")
        p.add_argument("--img-size", type=int, default=img_size)
        p.add_argument("--out", default=out, help="JSON result; a PNG of the same name goes next to it")
        p.add_argument("--machine", default=None, help="the machine's name in the results (default: from the CPU)")

    t = sub.add_parser("throughput", help="training images/s, loader images/s, epoch time and memory per config")
    common(t, "docs/benchmark/cpu-throughput.json", 224)
    t.add_argument("--configs", nargs="+", type=config_spec, default=[("seed", None), ("ours", None)],
                   metavar="NAME[@N]", help=f"{', '.join(CONFIGS)}; NAME@N: that one at world size N only "
                                            "(default: seed ours)")
    t.add_argument("--world-sizes", nargs="+", type=int, default=[1, 2])
    t.add_argument("--launcher", choices=["spawn", "single"], default="spawn",
                   help="spawn: fresh processes per measurement (needed for world size > 1 and for memory); "
                        "single: world size 1 inside this process, e.g. under a profiler")
    t.add_argument("--batch-size", type=int, default=16, help="per process")
    t.add_argument("--steps", type=int, default=20, help="timed steps per measurement")
    t.add_argument("--warmup", type=int, default=5, help="untimed steps before them")
    t.add_argument("--repeats", type=int, default=3)
    t.add_argument("--synthetic", action=BoolFlag, default=True, help="random tensors on the device, no loader")
    t.add_argument("--real", action=BoolFlag, default=True, help="the photos through each config's loader")

    d = sub.add_parser("data", help="images/s of each JPEG decode + transform path in one process")
    common(d, "docs/benchmark/cpu-data.json", 224)
    d.add_argument("--images", type=int, default=0, help="images timed per path, spread over the classes (0: all)")
    d.add_argument("--repeats", type=int, default=5)

    a = sub.add_parser("accuracy", help="validation accuracy of the seed recipe and of ours, trained from scratch")
    common(a, "docs/benchmark/accuracy.json", 128)
    a.add_argument("--epochs", type=int, default=20)
    a.add_argument("--batch-size", type=int, default=16)
    a.add_argument("--seed", type=int, default=0, help="initial weights, split and augmentation, for both recipes")
    a.add_argument("--variant", action="append", default=[], metavar="OPTIONS",
                   help="also train ours with these extra options, e.g. --variant '--lr 0.2' (repeatable)")
    a.add_argument("--skip-seed", action="store_true", help="train only ours and its variants")
    a.add_argument("--runs-dir", default=None, help="where ours' run folders go (default: runs/benchmark-accuracy-TIME)")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    with exit_on_error():
        {"throughput": throughput, "data": data_paths, "accuracy": accuracy}[args.command](args)


if __name__ == "__main__":
    main()
