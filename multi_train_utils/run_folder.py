"""The run folder: rank 0 creates it and writes every file in it, in the launcher's own lines.

    config.json  class_indices.json  split.json   once, before the epochs (--time-budget's epoch
                                                  count added when it is fixed)
    metrics.jsonl  TensorBoard's events           after every epoch, then its checkpoints:
    last.pth  best.pth                            torch.save to a temporary file, then renamed
    report.json  confusion_matrix.csv  *.png      at the end, with --report and --plots
    eval.json                                     with --eval-only
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.tensorboard import SummaryWriter

from multi_train_utils.distributed_utils import DistContext, broadcast_object
from multi_train_utils.train_eval_utils import Evaluation, Progress, Trained, global_batch
from utils import CONFIG_FILE, METRICS_FILE, SPLIT_FILE, DataSplit, UserError, save_split, write_json

# The share of an epoch the training thread waited, ready to run, for a core, above which the epoch's line
# says so: other programs on the cores, or more threads and workers than cores (docs/troubleshooting.md).
BUSY_CPU = 0.25
TENSORBOARD_SCALARS = ("train_loss", "train_acc", "val_loss", "val_acc", "lr", "train_images_per_sec")


def create_run_folder(args: argparse.Namespace, launcher: str, ctx: DistContext) -> Path:
    """The run folder, which rank 0 creates, proving it can write there; rank 0 prints the run's
    configuration. Collective: a broadcast of why rank 0 could not write there, if so."""
    path, error = args.output_dir or f"runs/{launcher}-{time.strftime('%Y%m%d-%H%M%S')}", None
    if ctx.is_main:
        try:
            Path(path).mkdir(parents=True, exist_ok=True)
            (Path(path) / ".write-test").write_bytes(b"")
            (Path(path) / ".write-test").unlink()
            for stale in Path(path).glob(".*.pth.tmp"):  # left by a process killed while saving
                stale.unlink()
        except OSError as e:
            error = f"cannot write to the output folder {path!r}: {e.strerror or e}"
    path, error = broadcast_object((path, error), ctx)
    if error:
        raise UserError(error)
    batch = global_batch(args, ctx)
    ctx.print0(f"config: {vars(args)}")
    ctx.print0(f"{launcher}: {ctx.world_size} process(es) on {ctx.device.type}, global batch {batch}"
               + (f" ({args.accum_steps} batches per step)" if args.accum_steps > 1 else "")
               + f", peak lr {args.lr * batch / 256:.4g} (= {args.lr} x {batch}/256), output in {path}")
    return Path(path)


def write_run_files(output_dir: Path, args: argparse.Namespace, launcher: str, split: DataSplit, data_root: str,
                    ctx: DistContext, progress: Progress) -> None:
    """Rank 0's files before the epochs: config.json, class_indices.json and split.json (the
    run's files, which a resumed run keeps: `data_root` is the folder they are under). A new run's
    metrics.jsonl starts empty (a resumed run's keeps the epochs its checkpoint holds: resume.py)."""
    if progress.epoch == progress.steps_in_epoch == 0:
        (output_dir / METRICS_FILE).unlink(missing_ok=True)
    fixed = {"budget_epochs": progress.budget_epochs} if progress.budget_epochs else {}  # --time-budget's count
    write_json(output_dir / CONFIG_FILE, {**vars(args), "launcher": launcher, "world_size": ctx.world_size,
                                          "torch": torch.__version__, **fixed})
    write_json(output_dir / "class_indices.json", dict(enumerate(split.class_names)))
    save_split(split, output_dir / SPLIT_FILE, data_root)


def epoch_record(epoch: int, trained: Trained, evaluated: Evaluation, split: DataSplit, args: argparse.Namespace,
                 ctx: DistContext) -> dict[str, Any]:
    """One line of metrics.jsonl (its readers: plots.py, outputs/scaling.py and the benchmarks).
    train_seen: the images drawn over every process (docs/exactness.md); lr: where the epoch left
    the schedule; data_wait_seconds: the mean over processes, a part of epoch_seconds."""
    return {"epoch": epoch, "train_loss": trained.train_loss, "train_acc": trained.train_acc,
            "train_total": len(split.train), "train_seen": trained.epoch_images, **evaluated.val, "lr": trained.lr,
            "epoch_seconds": trained.seconds, "eval_seconds": evaluated.seconds,
            "train_images_per_sec": trained.train_images / trained.seconds,
            "data_wait_seconds": trained.data_wait_seconds, "cpu_queued_seconds": trained.cpu_queued_seconds,
            "world_size": ctx.world_size, "global_batch_size": global_batch(args, ctx)}


def epoch_line(record: dict[str, Any], epochs: int, is_best: bool) -> str:
    busy = record["cpu_queued_seconds"] / record["epoch_seconds"]
    return (
        f"epoch {record['epoch']}/{epochs}: train loss {record['train_loss']:.4f} acc {record['train_acc']:.3f} | "
        f"val loss {record['val_loss']:.4f} acc {record['val_acc']:.4f} ({record['val_correct']}/{record['val_total']})"
        + (f", average {record['ema_val_acc']:.4f}" if "ema_val_acc" in record else "")
        + f" | {record['train_images_per_sec']:.1f} img/s, {record['epoch_seconds']:.1f}s "
        f"({100 * record['data_wait_seconds'] / record['epoch_seconds']:.0f}% waiting for data"
        + (f", {busy:.0%} for a free core" if busy > BUSY_CPU else "") + ")"
        + (" *best*" if is_best else "")
    )


def write_epoch(output_dir: Path, record: dict[str, Any], tensorboard: SummaryWriter) -> None:
    """metrics.jsonl's line and TensorBoard's points, before the checkpoint: a kill between the two
    leaves a line that a resumed run drops (resume.py); the other way round, the epoch would have none."""
    with open(output_dir / METRICS_FILE, "a") as f:
        f.write(json.dumps(record) + "\n")
    for key in TENSORBOARD_SCALARS:
        tensorboard.add_scalar(key, record[key], record["epoch"])
    tensorboard.flush()
