"""The training run every launcher shares, as its phases: split, run folder, model, resume,
loaders, epochs, final files.

`run(plan, ctx)` is the only entry point: it behaves the same in one process and in N, the
differences being confined to `DistContext` and the reductions in distributed_utils.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader
from torch.utils.tensorboard import SummaryWriter

from model import create_model, freeze_backbone
from multi_train_utils.checkpoint import (
    Progress,
    load_checkpoint,
    load_weights,
    make_checkpoint,
    restore_progress,
    restore_weights,
    shipped_weights,
)
from multi_train_utils.config import Plan, split_summary
from multi_train_utils.distributed_utils import DistContext, TerminationRequest, barrier, broadcast_buffers
from multi_train_utils.loaders import build_loaders, readable_split
from multi_train_utils.report import evaluation_report, report_line, write_report
from multi_train_utils.run_folder import (
    BEST,
    LAST,
    prepare_output_dir,
    resolve_resume,
    save_epoch,
    save_position,
    write_run_files,
)
from multi_train_utils.train_eval_utils import (
    PlacedModel,
    StoppedInEpoch,
    Training,
    build_training,
    evaluate,
    global_batch,
    peak_lr,
    place_model,
    predictions,
    train_one_epoch,
)
from plots import save_report_plots, save_run_plots
from utils import DataSplit, Preempted, write_json


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
        evaluate_only(placed, val_loader, split, resume_path or args.weights, output_dir, args.plots, ctx)
        return
    training = build_training(placed, args, ctx, len(train_loader))
    progress = resume(training, checkpoint, resume_path, args, ctx)
    del checkpoint  # the optimizer state is in the optimizer now: no second copy
    if ctx.is_main:
        write_run_files(output_dir, plan, split, progress.epoch, ctx)
    train_epochs(training, train_loader, val_loader, plan, split, progress, output_dir, ctx)
    best = use_best_weights(output_dir, training.placed.module, ctx)
    final_report(training.placed, val_loader, split, best, output_dir, ctx)
    if ctx.is_main and args.plots:
        save_run_plots(output_dir, split, args.img_size, args.seed)
    ctx.print0(f"done: best val_acc {progress.best_acc:.4f}; checkpoints and logs in {output_dir}")


def announce(plan: Plan, split: DataSplit, output_dir: Path, ctx: DistContext) -> None:
    """The configuration, printed once, and what it amounts to on this many processes."""
    args = plan.args
    batch = global_batch(args, ctx)
    accumulated = f" ({args.accum_steps} batches per step)" if args.accum_steps > 1 else ""
    ctx.print0(f"config: {vars(args)}")
    ctx.print0(split_summary(split))
    ctx.print0(
        f"{plan.launcher}: {ctx.world_size} process(es) on {ctx.device.type}, global batch {batch}{accumulated}, "
        f"peak lr {peak_lr(args, ctx):.4g} (= {args.lr} x {batch}/256), output in {output_dir}"
    )


def build_model(args: argparse.Namespace, class_names: list[str], checkpoint: dict[str, Any] | None,
                source: str | None, ctx: DistContext) -> PlacedModel:
    """The model with its initial weights (seeded, --weights, or the checkpoint's), on the device."""
    torch.manual_seed(args.seed)  # the same initial weights on every rank and in every rerun
    model = create_model(len(class_names), args.model)
    if args.weights:
        load_weights(model, args.weights, ctx.print0, args.model)
    if args.freeze_layers:
        freeze_backbone(model)
    if checkpoint is not None:
        restore_weights(checkpoint, model, args, class_names, source)
    placed = place_model(model, args, ctx.device)
    precision = "fp32" if placed.amp_dtype is None else str(placed.amp_dtype).removeprefix("torch.") + " autocast"
    ctx.print0(f"precision: {precision}, memory format: {'channels_last' if args.channels_last else 'NCHW'}")
    return placed


def resume(training: Training, checkpoint: dict[str, Any] | None, source: str | None, args: argparse.Namespace,
           ctx: DistContext) -> Progress:
    """Where the run stands: nowhere yet, or where `checkpoint` left it (the optimizer and the
    scaler restored). A position inside an epoch holds only for the same processes and batch:
    elsewhere that epoch starts over."""
    if checkpoint is None:
        return Progress()
    progress = restore_progress(checkpoint, training.optimizer, training.scaler,
                                training.ema.module if training.ema else None)
    message = f"resumed from {source}: {progress.epoch} epoch(s) done, best val_acc {progress.best_acc:.4f}"
    if progress.steps_in_epoch:
        same_steps = (checkpoint["world_size"] == ctx.world_size and checkpoint["args"]["batch_size"] == args.batch_size
                      and checkpoint["args"].get("accum_steps", 1) == args.accum_steps)
        if same_steps:
            message += f"; epoch {progress.epoch + 1} goes on after step {progress.steps_in_epoch}"
        else:
            message += (f"; it stopped inside epoch {progress.epoch + 1} with {checkpoint['world_size']} process(es) "
                        f"of batch {checkpoint['args']['batch_size']}, so that epoch starts over")
            progress = Progress(progress.epoch, progress.best_acc)
    ctx.print0(message)
    return progress


def evaluate_only(placed: PlacedModel, val_loader: DataLoader, split: DataSplit, source: str, output_dir: Path,
                  plots: bool, ctx: DistContext) -> None:
    result = evaluate(placed, val_loader, ctx)
    ctx.print0(f"eval {source}: acc {result['val_acc']:.4f} ({result['val_correct']}/{result['val_total']}), "
               f"loss {result['val_loss']:.4f}")
    if ctx.is_main:
        write_json(output_dir / "eval.json", {**result, "weights": source, "world_size": ctx.world_size})
    final_report(placed, val_loader, split, source, output_dir, ctx)
    if ctx.is_main and plots:
        save_report_plots(output_dir)


def use_best_weights(output_dir: Path, model: nn.Module, ctx: DistContext) -> str:
    """Load best.pth's weights into `model` on every rank (the model a user ships); say which."""
    barrier(ctx)  # rank 0 may still be writing it
    best = output_dir / BEST
    if not best.is_file():
        return "the final weights"
    checkpoint = load_checkpoint(best, mmap=True)
    model.load_state_dict(shipped_weights(checkpoint))
    average = " weight average" if checkpoint.get("better") == "ema" else ""
    return f"{best} (epoch {checkpoint['epoch']}{average})"


@torch.no_grad()
def final_report(placed: PlacedModel, val_loader: DataLoader, split: DataSplit, source: str, output_dir: Path,
                 ctx: DistContext) -> None:
    """report.json and confusion_matrix.csv for the weights in `placed`, which came from `source`."""
    report = evaluation_report(predictions(placed, val_loader), ctx, split, source)
    ctx.print0(report_line(report))
    if ctx.is_main:
        write_report(output_dir, report)


def train_epochs(training: Training, train_loader: DataLoader, val_loader: DataLoader, plan: Plan, split: DataSplit,
                 progress: Progress, output_dir: Path, ctx: DistContext) -> None:
    """Train, evaluate and save, epoch after epoch, from where `progress` stands."""
    args = plan.args
    writer = SummaryWriter(log_dir=str(output_dir)) if ctx.is_main else contextlib.nullcontext()
    with TerminationRequest() as termination, writer:
        training = dataclasses.replace(training, stop_requested=termination)
        for epoch in range(progress.epoch + 1, args.epochs + 1):
            started = time.perf_counter()
            train = train_or_stop(training, train_loader, epoch, progress, args, split, output_dir, ctx)
            train_seconds = time.perf_counter() - started
            val, better = evaluate_epoch(training, val_loader, ctx)
            record = epoch_record(epoch, train, val, training, split, train_seconds,
                                  time.perf_counter() - started - train_seconds, ctx)
            is_best = progress.record(epoch, max(val["val_acc"], val.get("ema_val_acc", 0.0)))  # the better one's
            if ctx.is_main:
                save_epoch(output_dir, checkpoint_of(training, progress, args, split, ctx, better), record, is_best,
                           writer)
                print(epoch_line(record, args.epochs, is_best), flush=True)


def evaluate_epoch(training: Training, val_loader: DataLoader, ctx: DistContext) -> tuple[dict[str, float], str]:
    """The model's validation metrics, and its weight average's (as ema_*) when there is one;
    and which of the two, "model" or "ema", scored higher. BatchNorm statistics come from rank
    0 first: every rank then evaluates the same weights."""
    broadcast_buffers(training.placed.module, ctx)
    val = evaluate(training.placed, val_loader, ctx)
    if training.ema is None:
        return val, "model"
    broadcast_buffers(training.ema.module, ctx)
    average = evaluate(dataclasses.replace(training.placed, module=training.ema.module), val_loader, ctx)
    val.update({f"ema_{k}": v for k, v in average.items()})
    return val, "ema" if average["val_acc"] > val["val_acc"] else "model"


def train_or_stop(training: Training, train_loader: DataLoader, epoch: int, progress: Progress,
                  args: argparse.Namespace, split: DataSplit, output_dir: Path, ctx: DistContext) -> dict[str, float]:
    """One training epoch, or what a stopped run left of it. On SIGTERM every process stops at
    the same step, rank 0 saves that position, and the run ends with Preempted."""
    train_loader.sampler.set_epoch(epoch, skip=progress.steps_in_epoch * args.batch_size)
    try:
        return train_one_epoch(training, train_loader, ctx, epoch, args.epochs, progress.steps_in_epoch,
                               progress.epoch_sums)
    except StoppedInEpoch as stop:
        if ctx.is_main:
            stopped = Progress(epoch - 1, progress.best_acc, stop.steps_done, tuple(stop.sums))
            save_position(output_dir, checkpoint_of(training, stopped, args, split, ctx))
        barrier(ctx)  # no process exits (and no launcher ends the job) before last.pth is on disk
        raise Preempted(f"SIGTERM: every process stopped after step {stop.steps_done} of epoch {epoch}; "
                        f"{output_dir / LAST} holds the position: resume with --resume auto") from None


def checkpoint_of(training: Training, progress: Progress, args: argparse.Namespace, split: DataSplit,
                  ctx: DistContext, better: str = "model") -> dict[str, Any]:
    return make_checkpoint(training.placed.module, training.optimizer, training.scaler, progress, args,
                           split.class_names, ctx.world_size, training.ema.module if training.ema else None, better)


def epoch_record(epoch: int, train: dict[str, float], val: dict[str, float], training: Training, split: DataSplit,
                 train_seconds: float, eval_seconds: float, ctx: DistContext) -> dict[str, Any]:
    """One line of metrics.jsonl (its readers: plots.py and the benchmarks)."""
    return {
        "epoch": epoch,
        "train_loss": train["train_loss"],
        "train_acc": train["train_acc"],
        "train_total": len(split.train),
        "train_seen": train["epoch_images"],  # drawn, over all processes: see docs/exactness.md
        **val,
        "lr": training.schedule(epoch * training.steps_per_epoch),  # where the epoch left the schedule
        "epoch_seconds": train_seconds,
        "eval_seconds": eval_seconds,
        "train_images_per_sec": train["train_images"] / train_seconds,
        "data_wait_seconds": train["data_wait_seconds"],  # mean over processes; part of epoch_seconds
        "world_size": ctx.world_size,
        "global_batch_size": training.global_batch,
    }


def epoch_line(record: dict[str, Any], epochs: int, is_best: bool) -> str:
    return (
        f"epoch {record['epoch']}/{epochs}: train loss {record['train_loss']:.4f} acc {record['train_acc']:.3f} | "
        f"val loss {record['val_loss']:.4f} acc {record['val_acc']:.4f} ({record['val_correct']}/{record['val_total']})"
        + (f", average {record['ema_val_acc']:.4f}" if "ema_val_acc" in record else "")
        + f" | {record['train_images_per_sec']:.1f} img/s, {record['epoch_seconds']:.1f}s "
        f"({100 * record['data_wait_seconds'] / record['epoch_seconds']:.0f}% waiting for data)"
        + (" *best*" if is_best else "")
    )
