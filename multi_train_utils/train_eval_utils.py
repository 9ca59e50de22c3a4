"""The training run every launcher shares: the model on its device, the training step and its
schedule, exact evaluation, and `run()`, which reads as the run's phases.

`run(plan, ctx)` is the only entry point: it behaves the same in one process and in N, the
differences being confined to `DistContext` and the reductions in distributed_utils.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

from model import convert_sync_batchnorm, create_model, freeze_backbone, set_train_mode
from multi_train_utils.checkpoint import (
    Progress,
    load_checkpoint,
    load_weights,
    make_checkpoint,
    restore_progress,
    restore_weights,
)
from multi_train_utils.config import Plan, split_summary
from multi_train_utils.distributed_utils import DistContext, all_reduce_min, all_reduce_sum, broadcast_buffers
from multi_train_utils.loaders import build_loaders, readable_split
from multi_train_utils.run_folder import (
    prepare_output_dir,
    resolve_resume,
    save_epoch,
    write_run_files,
)
from my_dataset import normalize
from plots import save_run_plots
from utils import DataSplit, TrainingDiverged, write_json

# Steps between looks at the loss on the host: each look is one small collective and one
# host sync, so the loop never waits on the device at every step.
CHECK_EVERY = 20
NO_BAD_STEP = 2**62


@dataclasses.dataclass(frozen=True)
class PlacedModel:
    """A model on its device, and how a batch is fed to it."""

    module: nn.Module  # unwrapped (no DDP, not compiled): what is saved, evaluated and resumed
    device: torch.device
    memory_format: torch.memory_format = torch.contiguous_format
    amp_dtype: torch.dtype | None = None  # autocast dtype in training; None: fp32

    def input(self, images: torch.Tensor) -> torch.Tensor:
        return model_input(images, self.device, self.memory_format)


def model_input(images: torch.Tensor, device: torch.device, memory_format: torch.memory_format) -> torch.Tensor:
    """A loader batch as the model takes it. The loaders give uint8 pixels, which cross to the
    device as they are and become normalised floats there, in the model's memory format (the
    layout changes while the pixels are still one byte each). A batch that is floating point
    already (synthetic input, tests) is taken as normalised."""
    images = images.to(device, non_blocking=True, memory_format=memory_format)
    return normalize(images) if images.dtype == torch.uint8 else images


def autocast_dtype(choice: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype for `--amp`, or None for full fp32."""
    if choice == "off":
        return None
    if choice == "fp16":
        return torch.float16
    if choice == "bf16":
        return torch.bfloat16
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else torch.float16
    # Without native bf16 instructions the CPU emulates it, slower than fp32.
    cpu = torch.cpu
    native = getattr(cpu, "_is_avx512_bf16_supported", lambda: False)() or getattr(cpu, "_is_amx_tile_supported", lambda: False)()
    return torch.bfloat16 if device.type == "cpu" and native else None


def place_model(model: nn.Module, args: argparse.Namespace, device: torch.device) -> PlacedModel:
    """Move the model to the device in the memory format and precision that `args` ask for."""
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
    model.to(device, memory_format=memory_format)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # fixed input sizes: autotuned kernels pay off from step 2
    return PlacedModel(model, device, memory_format, autocast_dtype(args.amp, device))


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Linear warm-up to the peak, then a cosine decay to `final_fraction` of it. The learning
    rate is a function of the step alone: a resumed run at any world size computes it afresh."""

    peak: float
    total_steps: int
    warmup_steps: int
    final_fraction: float

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.peak * (step + 1) / (self.warmup_steps + 1)
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps))
        return self.peak * (self.final_fraction + (1 - self.final_fraction) * 0.5 * (1 + math.cos(math.pi * progress)))


def build_schedule(args: argparse.Namespace, peak: float, steps_per_epoch: int) -> Schedule:
    total = max(1, args.epochs * steps_per_epoch)
    return Schedule(peak, total, min(total - 1, round(args.warmup_epochs * steps_per_epoch)), args.lrf)


def peak_lr(args: argparse.Namespace, ctx: DistContext) -> float:
    """The linear scaling rule: `--lr` is per 256 images of global batch."""
    return args.lr * args.batch_size * ctx.world_size / 256


def build_optimizer(model: nn.Module, args: argparse.Namespace) -> torch.optim.Optimizer:
    # Weight decay on BatchNorm scales and biases only fights the normalisation.
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.ndim > 1 else no_decay).append(param)
    groups = [
        {"params": decay, "weight_decay": args.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    # The loop sets the learning rate at every step. The fused kernel updates all parameters
    # in one pass; it exists for CPU and CUDA tensors.
    return torch.optim.SGD(groups, lr=0.0, momentum=args.momentum, nesterov=args.momentum > 0, fused=True)


@dataclasses.dataclass(frozen=True)
class Training:
    """Everything a training step uses, assembled once by `build_training`."""

    placed: PlacedModel
    model: nn.Module  # as the loop calls it: in DDP and compiled where asked
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    criterion: nn.Module
    schedule: Schedule
    steps_per_epoch: int
    global_batch: int  # images per optimizer step, over all processes


def build_training(placed: PlacedModel, args: argparse.Namespace, ctx: DistContext, steps_per_epoch: int) -> Training:
    """Wrap a placed model for training (SyncBatchNorm, DDP, compile) and build its optimizer,
    schedule, loss scaler and loss, as every launcher and the benchmarks train it."""
    if args.sync_bn and ctx.distributed:
        placed = dataclasses.replace(placed, module=convert_sync_batchnorm(placed.module, ctx.device))
    model = placed.module
    if ctx.distributed:
        model = DDP(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
    if args.compile:
        model = torch.compile(model)  # checkpoints and evaluation use the uncompiled placed.module
    # Loss scaling keeps small fp16 gradients from flushing to zero; bf16 has fp32's range.
    scaler = torch.amp.GradScaler(ctx.device.type, enabled=placed.amp_dtype == torch.float16)
    return Training(placed, model, build_optimizer(placed.module, args), scaler,
                    nn.CrossEntropyLoss(label_smoothing=args.label_smoothing),
                    build_schedule(args, peak_lr(args, ctx), steps_per_epoch), steps_per_epoch,
                    args.batch_size * ctx.world_size)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def train_one_epoch(training: Training, loader: Iterable, ctx: DistContext, epoch: int, epochs: int) -> dict[str, float]:
    """One pass over this rank's shard. Loss and accuracy stay on the device as running sums
    and are all-reduced once at the end; the host looks at them every CHECK_EVERY steps."""
    model, optimizer, scaler, placed = training.model, training.optimizer, training.scaler, training.placed
    set_train_mode(model)
    device = ctx.device
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, images
    images_seen = 0
    first_bad = torch.full((), NO_BAD_STEP, dtype=torch.int64, device=device)
    # Bars on rank 0 only, and only on a terminal (disable=None): logs stay free of them.
    bar = tqdm(loader, desc=f"epoch {epoch}/{epochs}", disable=None if ctx.is_main else True, leave=False,
               dynamic_ncols=True)
    steps = len(loader)
    steps_before = (epoch - 1) * training.steps_per_epoch
    for step, (images, labels) in enumerate(bar):
        images = placed.input(images)
        labels = labels.to(device, non_blocking=True)
        set_lr(optimizer, training.schedule(steps_before + step))
        with torch.autocast(device.type, dtype=placed.amp_dtype, enabled=placed.amp_dtype is not None):
            logits = model(images)
            loss = training.criterion(logits, labels)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)

        loss = loss.detach()
        n = labels.numel()
        # The count is known on the host; putting it in a device tensor every step would be a copy to the GPU.
        sums[:2] += torch.stack([loss.double() * n, (logits.argmax(1) == labels).sum().double()])
        images_seen += n
        # Remember the first non-finite step on the device; no sync here.
        first_bad = torch.where(~torch.isfinite(loss) & (first_bad == NO_BAD_STEP), step + 1, first_bad)
        if (step + 1) % CHECK_EVERY == 0 or step + 1 == steps:
            bad = int(all_reduce_min(first_bad.clone(), ctx))
            if bad != NO_BAD_STEP:
                raise TrainingDiverged(
                    f"the loss became NaN or infinite at epoch {epoch}, step {bad} of {steps}: "
                    "lower --lr, or check the data"
                )
            if ctx.is_main:
                loss_sum, correct = sums[:2].tolist()
                bar.set_postfix(loss=f"{loss_sum / images_seen:.4f}", acc=f"{correct / images_seen:.3f}",
                                lr=f"{optimizer.param_groups[0]['lr']:.2e}", refresh=False)
    bar.close()
    sums[2] = images_seen  # once per epoch
    loss_sum, correct, count = all_reduce_sum(sums, ctx).tolist()
    return {"train_loss": loss_sum / count, "train_acc": correct / count, "train_images": int(count)}


@torch.no_grad()
def evaluate(placed: PlacedModel, loader: Iterable, ctx: DistContext) -> dict[str, float]:
    """Exact accuracy and mean loss over the whole validation split: each rank sees a
    disjoint shard without padding, so every image counts exactly once. Always in fp32: it is
    a small share of the time, and bf16 rounding could differ with the batch composition,
    which changes with the world size, and flip a borderline image."""
    placed.module.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=ctx.device)  # loss sum, correct, images
    images_seen = 0
    criterion = nn.CrossEntropyLoss(reduction="sum")
    for images, labels in loader:
        labels = labels.to(ctx.device, non_blocking=True)
        logits = placed.module(placed.input(images))
        sums[:2] += torch.stack([criterion(logits, labels).double(), (logits.argmax(1) == labels).sum().double()])
        images_seen += labels.numel()
    sums[2] = images_seen
    loss_sum, correct, count = all_reduce_sum(sums, ctx).tolist()
    return {"val_loss": loss_sum / count, "val_acc": correct / count, "val_correct": int(correct), "val_total": int(count)}


def run(plan: Plan, ctx: DistContext) -> None:
    args = plan.args
    split = readable_split(plan, ctx)
    output_dir = prepare_output_dir(plan, ctx)
    resume_path = resolve_resume(plan, output_dir, ctx)
    announce(plan, split, output_dir, ctx)
    checkpoint = load_checkpoint(resume_path) if resume_path else None
    placed = build_model(args, split.class_names, checkpoint, resume_path, ctx)
    train_loader, val_loader = build_loaders(split, plan, ctx)
    if args.eval_only:
        evaluate_only(placed, val_loader, resume_path or args.weights, output_dir, ctx)
        return
    training = build_training(placed, args, ctx, len(train_loader))
    progress = Progress()
    if checkpoint is not None:
        progress = restore_progress(checkpoint, training.optimizer, training.scaler)
        ctx.print0(f"resumed from {resume_path}: {progress.epoch} epoch(s) done, best val_acc {progress.best_acc:.4f}")
        del checkpoint
    if ctx.is_main:
        write_run_files(output_dir, plan, split, progress.epoch, ctx)
    train_epochs(training, train_loader, val_loader, plan, split, progress, output_dir, ctx)
    if ctx.is_main:
        save_run_plots(output_dir, split, args.img_size, args.seed)
    ctx.print0(f"done: best val_acc {progress.best_acc:.4f}; checkpoints and logs in {output_dir}")


def announce(plan: Plan, split: DataSplit, output_dir: Path, ctx: DistContext) -> None:
    """The configuration, printed once, and what it amounts to on this many processes."""
    args = plan.args
    global_batch = args.batch_size * ctx.world_size
    ctx.print0(f"config: {vars(args)}")
    ctx.print0(split_summary(split))
    ctx.print0(
        f"{plan.launcher}: {ctx.world_size} process(es) on {ctx.device.type}, global batch {global_batch}, "
        f"peak lr {peak_lr(args, ctx):.4g} (= {args.lr} x {global_batch}/256), output in {output_dir}"
    )


def build_model(args: argparse.Namespace, class_names: list[str], checkpoint: dict[str, Any] | None,
                source: str | None, ctx: DistContext) -> PlacedModel:
    """ResNet34 with its initial weights (seeded, --weights, or the checkpoint's), on the device."""
    torch.manual_seed(args.seed)  # the same initial weights on every rank and in every rerun
    model = create_model(len(class_names))
    if args.weights:
        load_weights(model, args.weights, ctx.print0)
    if args.freeze_layers:
        freeze_backbone(model)
    if checkpoint is not None:
        restore_weights(checkpoint, model, class_names, source)
    placed = place_model(model, args, ctx.device)
    precision = "fp32" if placed.amp_dtype is None else str(placed.amp_dtype).removeprefix("torch.") + " autocast"
    ctx.print0(f"precision: {precision}, memory format: {'channels_last' if args.channels_last else 'NCHW'}")
    return placed


def evaluate_only(placed: PlacedModel, val_loader: DataLoader, source: str, output_dir: Path, ctx: DistContext) -> None:
    result = evaluate(placed, val_loader, ctx)
    ctx.print0(f"eval {source}: acc {result['val_acc']:.4f} ({result['val_correct']}/{result['val_total']}), "
               f"loss {result['val_loss']:.4f}")
    if ctx.is_main:
        write_json(output_dir / "eval.json", {**result, "weights": source, "world_size": ctx.world_size})


def train_epochs(training: Training, train_loader: DataLoader, val_loader: DataLoader, plan: Plan, split: DataSplit,
                 progress: Progress, output_dir: Path, ctx: DistContext) -> None:
    """Train, evaluate and save, epoch after epoch, from where `progress` stands."""
    args = plan.args
    writer = SummaryWriter(log_dir=str(output_dir)) if ctx.is_main else None
    try:
        for epoch in range(progress.epoch + 1, args.epochs + 1):
            train_loader.sampler.set_epoch(epoch)
            started = time.perf_counter()
            train = train_one_epoch(training, train_loader, ctx, epoch, args.epochs)
            train_seconds = time.perf_counter() - started
            broadcast_buffers(training.placed.module, ctx)
            val = evaluate(training.placed, val_loader, ctx)
            record = epoch_record(epoch, train, val, training, split, train_seconds,
                                  time.perf_counter() - started - train_seconds, ctx)
            is_best = progress.record(epoch, val["val_acc"])
            if ctx.is_main:
                checkpoint = make_checkpoint(training.placed.module, training.optimizer, training.scaler, progress,
                                             args, split.class_names, ctx.world_size)
                save_epoch(output_dir, checkpoint, record, is_best, writer)
                print(epoch_line(record, args.epochs, is_best), flush=True)
    finally:
        if writer is not None:
            writer.close()


def epoch_record(epoch: int, train: dict[str, float], val: dict[str, float], training: Training, split: DataSplit,
                 train_seconds: float, eval_seconds: float, ctx: DistContext) -> dict[str, Any]:
    """One line of metrics.jsonl (its readers: plots.py and the benchmarks)."""
    return {
        "epoch": epoch,
        "train_loss": train["train_loss"],
        "train_acc": train["train_acc"],
        "train_total": len(split.train),
        **val,
        "lr": training.schedule(epoch * training.steps_per_epoch),  # where the epoch left the schedule
        "epoch_seconds": train_seconds,
        "eval_seconds": eval_seconds,
        "train_images_per_sec": train["train_images"] / train_seconds,
        "world_size": ctx.world_size,
        "global_batch_size": training.global_batch,
    }


def epoch_line(record: dict[str, Any], epochs: int, is_best: bool) -> str:
    return (
        f"epoch {record['epoch']}/{epochs}: train loss {record['train_loss']:.4f} acc {record['train_acc']:.3f} | "
        f"val loss {record['val_loss']:.4f} acc {record['val_acc']:.4f} ({record['val_correct']}/{record['val_total']})"
        f" | {record['train_images_per_sec']:.1f} img/s, {record['epoch_seconds']:.1f}s" + (" *best*" if is_best else "")
    )
