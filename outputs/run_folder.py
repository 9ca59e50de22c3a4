"""The run folder: rank 0 creates it and writes every file in it; every rank reads the
checkpoint a run goes on from.

    config.json  class_indices.json  split.json     once, before the epochs (--time-budget's
                                                    epoch count added when it is fixed)
    last.pth  best.pth  metrics.jsonl  TensorBoard  after every epoch, by a thread beside the training
    report.json  confusion_matrix.csv  *.png        at the end (report.py, plotter.py)
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
from torch import nn
from torch.utils.tensorboard import SummaryWriter

from multi_train_utils.checkpoint import check_architecture, copy_atomic, load_checkpoint, make_checkpoint, save_atomic, snapshot
from multi_train_utils.config import Plan
from multi_train_utils.distributed_utils import (DistContext, broadcast_object, gather_objects,
                                                 prepare_helper_start)
from multi_train_utils.progress import Progress
from outputs.plotter import Plotter
from recipe.ema import WeightAverage
from recipe.schedule import global_batch, peak_lr
from speed.scaling import ScalingTally
from utils import (CONFIG_FILE, METRICS_FILE, SPLIT_FILE, DataSplit, ProjectError, UserError, save_split, write_json,
                   write_text_atomic)

LAST, BEST = "last.pth", "best.pth"
TENSORBOARD_SCALARS = ("train_loss", "train_acc", "val_loss", "val_acc", "lr", "train_images_per_sec")


def create_run_folder(plan: Plan, ctx: DistContext) -> Path:
    """The run folder, which rank 0 creates; then rank 0 prints the run's configuration.
    Collective: a broadcast of rank 0's folder (or of why it could not write there)."""
    args = plan.args
    output_dir = prepare_output_dir(plan, ctx)
    batch = global_batch(args, ctx)
    accumulated = f" ({args.accum_steps} batches per step)" if args.accum_steps > 1 else ""
    ctx.print0(f"config: {vars(args)}")
    ctx.print0(f"{plan.launcher}: {ctx.world_size} process(es) on {ctx.device.type}, global batch {batch}{accumulated}, "
               f"peak lr {peak_lr(args, ctx):.4g} (= {args.lr} x {batch}/256), output in {output_dir}")
    return output_dir


def read_resume_checkpoint(args: argparse.Namespace, output_dir: Path, ctx: DistContext) -> dict[str, Any] | None:
    """The checkpoint the run goes on from (--resume PATH, or for `auto` the run folder's
    last.pth if rank 0 finds one), read by every rank itself (on several machines: from a
    shared file system); None for a new run. Collectives: under --resume auto, a broadcast of
    whether rank 0 found last.pth, so that every rank reads it, or none, even if it appears
    meanwhile; resuming, an all_gather of what each rank read, or why it could not."""
    path = args.resume
    if path == "auto":
        found = (output_dir / LAST).is_file() if ctx.is_main else None
        path = str(output_dir / LAST) if broadcast_object(found, ctx) else None
    if not path:
        return None
    checkpoint, problem = None, None
    try:
        checkpoint = load_checkpoint(path)
        check_architecture(checkpoint, args, path)
    except UserError as e:
        problem = str(e)
    # all_gather: each rank read the file itself, and a lagging shared file system may show one
    # an older last.pth, or none: ranks at different positions would hang, or silently train
    # apart, and a rank that stopped alone would leave the others waiting in their next collective.
    found = gather_objects((problem, checkpoint and (checkpoint["epoch"], checkpoint.get("steps_in_epoch", 0))), ctx)
    if failed := [(rank, why) for rank, (why, _) in enumerate(found) if why]:
        rank, why = failed[0]
        raise UserError(f"rank {rank}: {why}" if ctx.distributed else why)
    positions = [position for _, position in found]
    if len(set(positions)) > 1:
        seen = ", ".join(f"rank {r}: epoch {e} step {s}" for r, (e, s) in enumerate(positions))
        raise UserError(f"the ranks read different checkpoints from {path} ({seen}): a shared file system that "
                        "has not caught up? Start the job again once every node sees the same file")
    return {**checkpoint, "loaded_from": path}


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


class RunFiles:
    """Rank 0's files of the run, for the state of `model` (unwrapped), `optimizer`, `scaler`
    and `ema`. Entered before the epochs (`with`): it writes config.json, class_indices.json and
    split.json, forks plotter.py's processes for the pictures of the data, opens TensorBoard's
    log and starts its writer thread; made, it has done nothing yet. Each epoch's checkpoint and metrics
    are written by one thread beside the training loop: the loop hands over a copy and goes on.
    At most one epoch's files are in flight; the next hand-over waits for them, and so do a stop
    (SIGTERM), the end of the run and a failure. A kill at any moment leaves the previous last.pth
    whole: save_atomic renames a finished file into place. Used as a context manager: its end
    waits for the files and the pictures, and says how the run's time went."""

    def __init__(self, output_dir: Path, plan: Plan, split: DataSplit, data_root: str, progress: Progress,
                 model: nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
                 ema: WeightAverage | None, ctx: DistContext, began: float | None = None):
        self.output_dir, self.plan, self.args, self.split, self.data_root = output_dir, plan, plan.args, split, data_root
        self.progress, self.ctx = progress, ctx
        self.model, self.optimizer, self.scaler, self.ema = model, optimizer, scaler, ema
        self.began = began or time.perf_counter()
        self.plotter: Plotter | None = None
        self._in_flight: list[Future] = []
        self._epoch = 0  # the epoch whose files are in flight
        # A multi-process run's last line: how the processes helped.
        self.scaling = ScalingTally(ctx.world_size, plan.args.batch_size, plan.args.accum_steps)

    def __enter__(self) -> RunFiles:
        """The run's first files, the pictures of its data, TensorBoard's log and the writer thread."""
        output_dir, plan, progress, ctx, split = self.output_dir, self.plan, self.progress, self.ctx, self.split
        # A resumed --time-budget run keeps the epoch count its first epoch fixed (progress.py).
        fixed = {"budget_epochs": progress.budget_epochs} if progress.budget_epochs else {}
        write_json(output_dir / CONFIG_FILE, {**vars(plan.args), "launcher": plan.launcher,
                                              "world_size": ctx.world_size, "torch": torch.__version__, **fixed})
        write_json(output_dir / "class_indices.json", dict(enumerate(split.class_names)))
        save_split(split, output_dir / SPLIT_FILE, self.data_root)
        truncate_metrics_after(output_dir / METRICS_FILE, progress.epoch)
        # Forked before this object starts threads of its own: a child has the parent's imports.
        if plan.args.plots:
            self.plotter = Plotter(output_dir, prepare_helper_start(ctx)).__enter__()  # its processes forked now
            self.plotter.draw_data()
        self.tensorboard = SummaryWriter(log_dir=str(output_dir))
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="epoch-writer")
        self.epochs_began = self.epochs_ended = time.perf_counter()
        return self

    def save_epoch(self, epoch: int, progress: Progress, train_stats: dict[str, Any], evaluated: Any,
                   is_best: bool) -> None:
        """Print the epoch's line, and write its checkpoint and metrics in the background.
        `evaluated`: its Evaluation (train_eval_utils.py)."""
        started = time.perf_counter()
        self.wait()
        record = epoch_record(epoch, train_stats, evaluated, global_batch(self.args, self.ctx), self.split,
                              self.ctx.world_size)
        copy = snapshot(make_checkpoint(self.model, self.optimizer, self.scaler, progress, self.args,
                                        self.split.class_names, self.ctx.world_size,
                                        self.ema.module if self.ema else None, evaluated.better, evaluated.evaluated_bn))
        record["checkpoint_seconds"] = time.perf_counter() - started
        self.scaling.add(train_stats)
        print(epoch_line(record, progress.last_epoch, is_best), flush=True)
        self._epoch = epoch
        # The checkpoints go first: metrics.jsonl never names an epoch that a resumed run trains again.
        self._in_flight = [self._thread.submit(save_checkpoints, copy, self.output_dir, is_best),
                           self._thread.submit(record_epoch, self.output_dir, record, self.tensorboard)]
        self.epochs_ended = time.perf_counter()

    def save_position(self, progress: Progress) -> None:
        """A stopped run's last.pth, its position inside an epoch in `progress`, written now,
        after the write in flight: the process exits next."""
        self.wait()
        try:
            save_atomic(make_checkpoint(self.model, self.optimizer, self.scaler, progress, self.args,
                                        self.split.class_names, self.ctx.world_size,
                                        self.ema.module if self.ema else None), self.output_dir / LAST)
        except (OSError, RuntimeError) as e:  # torch.save's RuntimeError: a full disk under its zip writer
            raise CheckpointWriteFailed(progress.epoch + 1, e, self.output_dir) from None

    def wait(self) -> None:
        """Until the files in flight are on disk; a write that failed (a full disk) raises here,
        as CheckpointWriteFailed."""
        in_flight, self._in_flight = self._in_flight, []
        for job in in_flight:
            if (error := job.exception()) is not None:
                raise CheckpointWriteFailed(self._epoch, error, self.output_dir) from None

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        """After the last epoch and the report: wait for the files and the pictures, then say
        where the time went. After a failure, the error that ends the run is the one to report."""
        ended = time.perf_counter()
        try:
            self.wait()
        except Exception:
            if kind is None:
                raise
        finally:
            self._thread.shutdown()
            self.tensorboard.close()
            if self.plotter:
                if kind is None:
                    self.plotter.draw_results()
                self.plotter.__exit__(kind)
        if kind is None:
            waited = f", {self.plotter.waited_line()}" if self.plotter else ""
            print(f"time: start-up {self.epochs_began - self.began:.1f}s, epochs "
                  f"{self.epochs_ended - self.epochs_began:.1f}s, final report {ended - self.epochs_ended:.1f}s{waited}")
            self.scaling.report(self.output_dir)
            print(f"done: best val_acc {self.progress.best_acc:.4f}; checkpoints and logs in {self.output_dir}", flush=True)


def truncate_metrics_after(path: Path, completed_epochs: int) -> None:
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
    write_text_atomic(path, "".join(line + "\n" for line in kept))


def save_checkpoints(checkpoint: dict[str, Any], output_dir: Path, is_best: bool) -> None:
    """An epoch's last.pth, and its best.pth first where the epoch is the best so far: a kill
    between the two leaves the previous epoch's last.pth, whose resumed run trains this epoch
    again; never a best.pth behind the best accuracy last.pth records."""
    if is_best:
        save_atomic(checkpoint, output_dir / BEST)
        copy_atomic(output_dir / BEST, output_dir / LAST)  # a hard link where the file system has them
    else:
        save_atomic(checkpoint, output_dir / LAST)


def record_epoch(output_dir: Path, record: dict[str, Any], writer: SummaryWriter) -> None:
    """After an epoch's checkpoints: its line of metrics.jsonl, and TensorBoard's."""
    with open(output_dir / METRICS_FILE, "a") as f:
        f.write(json.dumps(record) + "\n")
    for key in TENSORBOARD_SCALARS:
        writer.add_scalar(key, record[key], record["epoch"])
    writer.flush()


def epoch_record(epoch: int, train: dict[str, Any], evaluated: Any, global_batch_size: int, split: DataSplit,
                 world_size: int) -> dict[str, Any]:
    """One line of metrics.jsonl (its readers: plots.py and the benchmarks)."""
    return {
        "epoch": epoch,
        "train_loss": train["train_loss"],
        "train_acc": train["train_acc"],
        "train_total": len(split.train),
        "train_seen": train["epoch_images"],  # drawn, over all processes: see docs/exactness.md
        **evaluated.val,
        "lr": train["lr"],  # where the epoch left the schedule
        "epoch_seconds": train["seconds"],
        "eval_seconds": evaluated.seconds,
        "train_images_per_sec": train["train_images"] / train["seconds"],
        "data_wait_seconds": train["data_wait_seconds"],  # mean over processes; part of epoch_seconds
        "world_size": world_size,
        "global_batch_size": global_batch_size,
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
