"""The run folder: rank 0 creates it and writes every file in it; a resumed run finds its place.

    config.json  class_indices.json  split.json     once, at the start (--time-budget's
                                                    epoch count added after epoch 1)
    last.pth  best.pth  metrics.jsonl  TensorBoard  after every epoch, by a background thread
    eval.json                                       with --eval-only
"""
from __future__ import annotations

import argparse
import json
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch.utils.tensorboard import SummaryWriter

from multi_train_utils.budget import EpochTime
from multi_train_utils.checkpoint import Progress, copy_atomic, make_checkpoint, save_atomic, snapshot
from multi_train_utils.config import Plan
from multi_train_utils.distributed_utils import DistContext, broadcast_object
from multi_train_utils.loaders import RunData
from multi_train_utils.train_eval_utils import Evaluation, Training
from utils import CONFIG_FILE, METRICS_FILE, SPLIT_FILE, DataSplit, ProjectError, UserError, read_json, save_split, write_json

LAST, BEST = "last.pth", "best.pth"
TENSORBOARD_SCALARS = ("train_loss", "train_acc", "val_loss", "val_acc", "lr", "train_images_per_sec")


def prepare_output_dir(plan: Plan, ctx: DistContext) -> Path:
    """Rank 0 picks and creates the run folder and proves it can write there; every rank
    learns the outcome, so an unwritable folder stops all of them before training."""
    path, error = None, None
    if ctx.is_main:
        path = plan.args.output_dir or f"runs/{plan.launcher}-{time.strftime('%Y%m%d-%H%M%S')}"
        try:
            Path(path).mkdir(parents=True, exist_ok=True)
            probe = Path(path) / ".write-test"
            probe.write_bytes(b"")
            probe.unlink()
            for stale in Path(path).glob(".*.pth*.tmp"):  # left by a process killed while saving
                stale.unlink()
        except OSError as e:
            error = f"cannot write to the output folder {path!r}: {e.strerror or e}"
    path, error = broadcast_object((path, error), ctx)
    if error:
        raise UserError(error)
    return Path(path)


def write_run_files(output_dir: Path, plan: Plan, data: RunData, epochs_done: int, ctx: DistContext) -> None:
    """What a run records: its configuration, classes and exact split, the files a resumed run
    trains on again. A resumed run also forgets the epochs its checkpoint does not hold."""
    write_json(output_dir / CONFIG_FILE, {**vars(plan.args), "launcher": plan.launcher, "world_size": ctx.world_size,
                                          "torch": torch.__version__})
    write_json(output_dir / "class_indices.json", dict(enumerate(data.split.class_names)))
    save_split(data.split, output_dir / SPLIT_FILE, data.root)
    restore_metrics(output_dir / METRICS_FILE, epochs_done)


def record_budget_epochs(output_dir: Path, epochs: int) -> None:
    """Add to config.json the epoch count --time-budget fixed."""
    path = output_dir / CONFIG_FILE
    write_json(path, {**read_json(path), "budget_epochs": epochs})


def restore_metrics(path: Path, completed_epochs: int) -> None:
    """Keep only the epochs the checkpoint includes: a run killed after writing metrics for
    epoch k+1 but before its checkpoint must not log epoch k+1 twice once resumed."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["epoch"] <= completed_epochs:
                kept.append(line)
        except (ValueError, KeyError, TypeError):
            pass  # a line cut short by a kill mid-append
    path.write_text("".join(line + "\n" for line in kept))


def save_position(output_dir: Path, checkpoint: dict[str, Any]) -> None:
    """Rank 0's file for a run stopped inside an epoch: last.pth alone; metrics.jsonl only ever
    holds finished epochs."""
    save_atomic(checkpoint, output_dir / LAST)


def save_epoch(output_dir: Path, checkpoint: dict[str, Any], record: dict[str, Any], is_best: bool,
               writer: SummaryWriter) -> None:
    """Rank 0's files for one epoch. The checkpoint goes first: metrics.jsonl never mentions
    an epoch that a resumed run would train again."""
    save_atomic(checkpoint, output_dir / LAST)
    if is_best:
        copy_atomic(output_dir / LAST, output_dir / BEST)
    with open(output_dir / METRICS_FILE, "a") as f:
        f.write(json.dumps(record) + "\n")
    for key in TENSORBOARD_SCALARS:
        writer.add_scalar(key, record[key], record["epoch"])
    writer.flush()


class CheckpointWriteFailed(ProjectError):
    """Rank 0 could not write an epoch's files (a full disk, a lost network file system)."""

    def __init__(self, epoch: int, error: BaseException, output_dir: Path):
        reason = f"{type(error).__name__}: {error}" if not isinstance(error, OSError) else (
            f"{error.strerror or error}" + (f": {error.filename}" if error.filename else ""))
        try:
            room = f"; {shutil.disk_usage(output_dir).free / 2**30:.2f} GiB free there"
        except OSError:
            room = ""
        super().__init__(f"rank 0 could not write epoch {epoch}'s checkpoint and metrics to {output_dir} "
                         f"({reason.strip()}{room}): a full disk, a file-size limit or a lost network file system")
        self.epoch = epoch


class EpochWriter:
    """Rank 0's files of each epoch, written by one thread beside the training loop: the loop
    hands over a copy of the checkpoint and goes on training. At most one epoch's files are in
    flight; the next hand-over waits for them, and so do a stop (SIGTERM), the end of the run and
    a failure. A kill at any moment leaves the previous last.pth whole: save_atomic renames a
    finished file into place."""

    def __init__(self, output_dir: Path):
        self.output_dir = output_dir
        self.tensorboard = SummaryWriter(log_dir=str(output_dir))
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="epoch-writer")
        self._in_flight: Future | None = None
        self._epoch = 0  # the epoch whose files are in flight

    def save_epoch(self, checkpoint: dict[str, Any], record: dict[str, Any], is_best: bool) -> None:
        """Write one epoch's files in the background. `record` gains checkpoint_seconds: what the
        hand-over cost the loop (waiting for the previous epoch's files, copying the state)."""
        started = time.perf_counter()
        self.wait()
        copy = snapshot(checkpoint)
        record["checkpoint_seconds"] = time.perf_counter() - started
        self._epoch = record["epoch"]
        self._in_flight = self._thread.submit(save_epoch, self.output_dir, copy, record, is_best, self.tensorboard)

    def save_position(self, checkpoint: dict[str, Any]) -> None:
        """A stopped run's last.pth, written now, after the write in flight: the process exits next."""
        self.wait()
        try:
            save_position(self.output_dir, checkpoint)
        except OSError as e:
            raise CheckpointWriteFailed(checkpoint["epoch"] + 1, e, self.output_dir) from None

    def wait(self) -> None:
        """Until the files in flight are on disk; a write that failed (a full disk) raises here,
        as CheckpointWriteFailed."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None and (error := in_flight.exception()) is not None:
            raise CheckpointWriteFailed(self._epoch, error, self.output_dir) from None

    def __enter__(self) -> EpochWriter:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        try:
            self.wait()
        except Exception:
            if kind is None:
                raise  # else the error that is ending the run is the one to report
        finally:
            self._thread.shutdown()
            self.tensorboard.close()


def checkpoint_of(training: Training, progress: Progress, args: argparse.Namespace, split: DataSplit,
                  ctx: DistContext, evaluated: Evaluation | None = None) -> dict[str, Any]:
    """What the run has come to; `evaluated`: its last epoch's evaluation (none inside an epoch)."""
    return make_checkpoint(training.placed.module, training.optimizer, training.scaler, progress, args,
                           split.class_names, ctx.world_size, training.ema.module if training.ema else None,
                           evaluated.better if evaluated else "model", evaluated.evaluated_bn if evaluated else None)


def epoch_record(epoch: int, train: dict[str, float], evaluated: Evaluation, took: EpochTime, training: Training,
                 split: DataSplit, ctx: DistContext) -> dict[str, Any]:
    """One line of metrics.jsonl (its readers: plots.py and the benchmarks)."""
    return {
        "epoch": epoch,
        "train_loss": train["train_loss"],
        "train_acc": train["train_acc"],
        "train_total": len(split.train),
        "train_seen": train["epoch_images"],  # drawn, over all processes: see docs/exactness.md
        **evaluated.val,
        "lr": training.schedule(epoch * training.steps_per_epoch),  # where the epoch left the schedule
        "epoch_seconds": took.train,
        "eval_seconds": took.eval,
        "train_images_per_sec": train["train_images"] / took.train,
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
