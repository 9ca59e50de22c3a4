"""The training run every launcher shares, as its phases: split, run folder, model, resume,
loaders, epochs, final files.

`run(plan, ctx)` is the only entry point: it behaves the same in one process and in N, the
differences being confined to `DistContext` and the reductions in distributed_utils.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from model import freeze_backbone, model_for
from multi_train_utils.budget import (
    EpochTime,
    budget_message,
    budget_seconds,
    epochs_that_fit,
    most_epochs,
    room_for_another,
    run_sizes,
)
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
from multi_train_utils.distributed_utils import (
    DistContext,
    TerminationRequest,
    barrier,
    broadcast_buffers,
    broadcast_object,
)
from multi_train_utils.loaders import (
    DeviceAugmentedLoader,
    EpochPasses,
    RunData,
    build_loaders,
    recalibration_batches,
    run_data,
)
from multi_train_utils.plotter import Plotter
from multi_train_utils.report import evaluation_report, report_line, write_report
from multi_train_utils.run_folder import (
    BEST,
    LAST,
    EpochWriter,
    prepare_output_dir,
    record_budget_epochs,
    resolve_resume,
    write_run_files,
)
from multi_train_utils.train_eval_utils import (
    BatchNormRecalibration,
    Outputs,
    PlacedModel,
    StoppedInEpoch,
    Training,
    batch_norm_statistics,
    build_schedule,
    build_training,
    global_batch,
    peak_lr,
    place_model,
    train_one_epoch,
    validation_metrics,
    validation_outputs,
)
from utils import DataSplit, Preempted, write_json


def run(plan: Plan, ctx: DistContext) -> None:
    started = clock()
    args = plan.args
    output_dir = prepare_output_dir(plan, ctx)
    plotter = Plotter(output_dir) if ctx.is_main and args.plots else None  # forked before the run starts threads
    with plotter or contextlib.nullcontext():
        resume_path = resolve_resume(plan, output_dir, ctx)
        checkpoint = load_checkpoint(resume_path) if resume_path else None
        begun = start_up(plan, checkpoint, resume_path, output_dir, ctx)
        if args.eval_only:
            evaluate_only(begun.placed, begun.val_loader, begun.data.split, resume_path or args.weights, output_dir,
                          plotter, args, ctx)
            return
        training = build_training(begun.placed, args, ctx, len(begun.train_loader))
        progress = resume(training, checkpoint, resume_path, args, begun.data.lost_files, ctx)
        del checkpoint  # the optimizer state is in the optimizer now: no second copy
        if ctx.is_main:
            write_run_files(output_dir, plan, begun.data, progress.epoch, ctx)
        if plotter:
            plotter.draw_data()  # the class balance and augmented samples: split.json and config.json exist now
        epochs_started = clock()
        # On the CPU the last training steps use every core already: loading the validation
        # batches beside them would only move time from evaluation into training.
        passes = EpochPasses(begun.train_loader, begun.val_loader, val_ahead=ctx.device.type != "cpu")
        best = train_epochs(training, passes, plan, begun.data.split, progress, output_dir, ctx)
        epochs_ended = clock()
        report_of_best(best, training.placed, begun.val_loader, begun.data.split, output_dir, ctx)
        reported = clock()
        if plotter:
            plotter.draw_results()
    ctx.print0(f"time: start-up {epochs_started - started:.1f}s ({begun.phases}), "
               f"epochs {epochs_ended - epochs_started:.1f}s, final report {reported - epochs_ended:.1f}s"
               + (f", {plotter.waited_line()}" if plotter else ""))
    ctx.print0(f"done: best val_acc {progress.best_acc:.4f}; checkpoints and logs in {output_dir}")


@dataclasses.dataclass(frozen=True)
class Begun:
    """What the start-up made: the run's files, its model on the device, its loaders, and the
    seconds each part took (for the `time:` line)."""

    data: RunData
    placed: PlacedModel
    train_loader: DataLoader | DeviceAugmentedLoader
    val_loader: DataLoader
    phases: Phases


def start_up(plan: Plan, checkpoint: dict[str, Any] | None, resume_path: str | None, output_dir: Path,
             ctx: DistContext) -> Begun:
    """The data and the model, side by side: the model is built on a thread of its own while
    this one lists, checks and splits the photos and makes the loaders, since neither needs the
    other (on a GPU, CUDA's start alone takes seconds). Nothing on this thread draws from torch's
    random generator, so the seeded weights are those a model built alone would have."""
    phases, said = Phases(), []
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="model") as beside:
        building = beside.submit(phases.timed, "model", build_model, plan.args, classes_to_build(plan, checkpoint),
                                 ctx.device, said.append)
        data = phases.timed("data", run_data, plan, resume_path, ctx)
        announce(plan, data.split, output_dir, ctx)
        train_loader, val_loader = phases.timed("loaders", build_loaders, data.split, plan, ctx)
        placed = phases.waited_for("model", building)
    for line in said:
        ctx.print0(line)
    if checkpoint is not None:
        restore_weights(checkpoint, placed.module, plan.args, data.split.class_names, resume_path)
    return Begun(data, placed, train_loader, val_loader, phases)


class Phases:
    """Phases of the start-up and their seconds, said as "data 0.1s, model 0.3s (waited 0.2s)"."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.waits: dict[str, float] = {}

    def timed(self, phase: str, step: Callable[..., Any], *args: Any) -> Any:
        began = time.perf_counter()
        try:
            return step(*args)
        finally:
            self.seconds[phase] = time.perf_counter() - began

    def waited_for(self, phase: str, running: Future) -> Any:
        """`running`'s result, noting how long this thread waited for it."""
        began = time.perf_counter()
        try:
            return running.result()
        finally:
            self.waits[phase] = time.perf_counter() - began

    def __str__(self) -> str:
        return ", ".join(f"{phase} {seconds:.1f}s" + (f" (waited {self.waits[phase]:.1f}s)" if phase in self.waits else "")
                         for phase, seconds in self.seconds.items())


def classes_to_build(plan: Plan, checkpoint: dict[str, Any] | None) -> int:
    """The model's class count, known before the split: a resumed run's checkpoint's, else the
    folder's (leaving out unreadable files never empties a class: that is an error)."""
    return len(checkpoint["class_names"] if checkpoint is not None else plan.class_names)


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


def build_model(args: argparse.Namespace, num_classes: int, device: torch.device,
                say: Callable[[str], None]) -> PlacedModel:
    """The model with its initial weights (seeded, or --weights), on the device. `say` keeps
    its lines for the caller to print in order: this runs beside the data's start-up."""
    torch.manual_seed(args.seed)  # the same initial weights in every rerun (DDP then copies rank 0's to all)
    model = model_for(args, num_classes)
    if args.weights:
        load_weights(model, args.weights, say, args.model)
    if args.freeze_layers:
        freeze_backbone(model)
    placed = place_model(model, args, device)
    precision = "fp32" if placed.amp_dtype is None else str(placed.amp_dtype).removeprefix("torch.") + " autocast"
    say(f"precision: {precision}, memory format: {'channels_last' if args.channels_last else 'NCHW'}")
    return placed


def resume(training: Training, checkpoint: dict[str, Any] | None, source: str | None, args: argparse.Namespace,
           lost_files: bool, ctx: DistContext) -> Progress:
    """Where the run stands: nowhere yet, or where `checkpoint` left it (the optimizer and the
    scaler restored). A position inside an epoch holds only for the same processes, batch and
    files: elsewhere that epoch starts over."""
    if checkpoint is None:
        return Progress()
    progress = restore_progress(checkpoint, training.optimizer, training.scaler,
                                training.ema.module if training.ema else None)
    message = f"resumed from {source}: {progress.epoch} epoch(s) done, best val_acc {progress.best_acc:.4f}"
    if progress.steps_in_epoch:
        same_steps = (checkpoint["world_size"] == ctx.world_size and checkpoint["args"]["batch_size"] == args.batch_size
                      and checkpoint["args"].get("accum_steps", 1) == args.accum_steps)
        if same_steps and not lost_files:
            message += f"; epoch {progress.epoch + 1} goes on after step {progress.steps_in_epoch}"
        else:
            why = (", whose order of images held the files left out" if lost_files else
                   f" with {checkpoint['world_size']} process(es) of batch {checkpoint['args']['batch_size']}")
            message += f"; it stopped inside epoch {progress.epoch + 1}{why}, so that epoch starts over"
            progress = dataclasses.replace(progress, steps_in_epoch=0, epoch_sums=(0.0, 0.0, 0.0))
    ctx.print0(message)
    return progress


def evaluate_only(placed: PlacedModel, val_loader: DataLoader, split: DataSplit, source: str, output_dir: Path,
                  plotter: Plotter | None, args: argparse.Namespace, ctx: DistContext) -> None:
    """--eval-only: one pass over the validation set gives eval.json and the report. With
    --bn-recalibrate the statistics are recomputed first (a checkpoint of a run that did so
    holds them already: the same ones come out)."""
    recalibrate = recalibration(split, args)
    if recalibrate:
        placed = recalibrate(placed, ctx)
    outputs = validation_outputs(placed, val_loader)
    result = validation_metrics(outputs, ctx)
    ctx.print0(f"eval {source}: acc {result['val_acc']:.4f} ({result['val_correct']}/{result['val_total']}), "
               f"loss {result['val_loss']:.4f}")
    if ctx.is_main:
        write_json(output_dir / "eval.json", {**result, "weights": source, "world_size": ctx.world_size})
    final_report(outputs, split, source, output_dir, ctx)
    if plotter:
        plotter.draw_report()


@dataclasses.dataclass(frozen=True)
class BestEpoch:
    """The best epoch of this run so far, and this rank's validation outputs of the weights
    best.pth ships (the model's or the average's): the final report is made from them."""

    epoch: int
    better: str  # "model" or "ema"
    outputs: Outputs


def report_of_best(best: BestEpoch | None, placed: PlacedModel, val_loader: DataLoader, split: DataSplit,
                   output_dir: Path, ctx: DistContext) -> None:
    """report.json for best.pth's weights, from the outputs its epoch's evaluation kept. When
    that epoch ran before a resume, best.pth is loaded and evaluated again."""
    if best is not None:
        final_report(best.outputs, split, best_source(output_dir / BEST, best.epoch, best.better), output_dir, ctx)
        return
    source = use_best_weights(output_dir, placed.module, ctx)
    final_report(validation_outputs(placed, val_loader), split, source, output_dir, ctx)


def best_source(path: Path, epoch: int, better: str) -> str:
    return f"{path} (epoch {epoch}{' weight average' if better == 'ema' else ''})"


def use_best_weights(output_dir: Path, model: nn.Module, ctx: DistContext) -> str:
    """Load best.pth's weights into `model` on every rank (the model a user ships); say which."""
    barrier(ctx)  # rank 0 may still be writing it
    best = output_dir / BEST
    if not best.is_file():
        return "the final weights"
    checkpoint = load_checkpoint(best, mmap=True)
    model.load_state_dict(shipped_weights(checkpoint))
    return best_source(best, checkpoint["epoch"], checkpoint.get("better", "model"))


def final_report(outputs: Outputs, split: DataSplit, source: str, output_dir: Path, ctx: DistContext) -> None:
    """report.json and confusion_matrix.csv for the weights that gave `outputs`, which came from `source`."""
    report = evaluation_report(outputs, ctx, split, source)
    ctx.print0(report_line(report))
    if ctx.is_main:
        write_report(output_dir, report)


# The epochs' stopwatch, which --time-budget counts by; tests replace it to fake slow epochs.
clock = time.perf_counter


def train_epochs(training: Training, passes: EpochPasses, plan: Plan, split: DataSplit, progress: Progress,
                 output_dir: Path, ctx: DistContext) -> BestEpoch | None:
    """Train, evaluate and save, epoch after epoch, from where `progress` stands; the best
    epoch this call trained, if any beat the ones before. How many epochs (--epochs, or what
    --time-budget fits) is EpochCount's business."""
    args = plan.args
    files = EpochWriter(output_dir) if ctx.is_main else None
    recalibrate = recalibration(split, args)
    best = None
    with TerminationRequest() as termination, files or contextlib.nullcontext():
        count = EpochCount(args, progress, passes.train_loader, output_dir, ctx)
        training = count.fitted(dataclasses.replace(training, stop_requested=termination))
        ctx.print0(f"training: epoch {progress.epoch + 1} of {count.shown()}, "
                   f"{len(passes.train_loader)} batches per process")
        epoch = progress.epoch + 1
        while count.starts(epoch):
            steps_before = progress.steps_in_epoch
            started = clock()
            train = train_or_stop(training, passes, epoch, count.total(), progress, args, split, output_dir, files, ctx)
            trained = clock()
            # The validation pass first: its first one forks the loader's workers, which is best
            # done while no other loader is handing out batches.
            passes.begin_val()
            if count.known_to_follow(epoch):
                passes.begin_train(epoch + 1)  # its batches load while the model evaluates
            evaluated = evaluate_epoch(training, passes, recalibrate, ctx)
            took = EpochTime(trained - started, clock() - trained)
            record = epoch_record(epoch, train, evaluated.val, training, split, took.train, took.eval, ctx)
            is_best = progress.record(epoch, max(evaluated.val["val_acc"], evaluated.val.get("ema_val_acc", 0.0)),
                                      took.train, took.eval)  # the better one's
            if is_best:
                best = BestEpoch(epoch, evaluated.better, evaluated.outputs)
            training = count.timed(took, steps_before, training)
            if files:
                files.save_epoch(checkpoint_of(training, progress, args, split, ctx, evaluated), record, is_best)
                print(epoch_line(record, count.total(), is_best), flush=True)
            # The other ranks do not wait for these writes: they meet rank 0 again at its next
            # collective (the next epoch's, or the final report's).
            epoch += 1
    return best


def recalibration(split: DataSplit, args: argparse.Namespace) -> BatchNormRecalibration | None:
    """--bn-recalibrate's, its images prepared on first use."""
    if not args.bn_recalibrate:
        return None
    return BatchNormRecalibration(functools.cache(lambda: recalibration_batches(split, args)))


class EpochCount:
    """How many epochs the run trains, and whether the next one starts. --epochs decides, or
    under --time-budget epoch 1's time fixes the count once (rank 0's clock, one decision
    for all ranks, recorded in `progress` and so in every checkpoint), and before each later
    epoch a guard ends the run when that epoch's training would not fit in what is left.
    Whenever the count is fixed, the learning-rate decay and the crop sizes are fitted to it."""

    def __init__(self, args: argparse.Namespace, progress: Progress, train_loader: DataLoader | DeviceAugmentedLoader,
                 output_dir: Path, ctx: DistContext):
        self.args, self.progress, self.train_loader, self.output_dir, self.ctx = args, progress, train_loader, output_dir, ctx
        self.budget = budget_seconds(args)
        self.resumed_at = progress.epoch + 1

    def total(self) -> int:
        """The epochs the run trains in all: as the budget fixed them, else --epochs (before the
        budget has fixed them: the most it may)."""
        return self.progress.budget_epochs or most_epochs(self.args)

    def shown(self) -> str:
        """The count as the first training line says it: the number, or under a budget not yet
        fixed, how it will be decided."""
        if self.progress.budget_epochs or self.args.time_budget is None:
            return str(self.total())
        return (f"as many as --time-budget {self.args.time_budget} fits (at most {most_epochs(self.args)}; "
                f"counted after this epoch)")

    def fitted(self, training: Training) -> Training:
        """`training` fitted to the count a resumed run fixed before (it stays that one)."""
        return self.sized_to(self.progress.budget_epochs, training) if self.progress.budget_epochs else training

    def starts(self, epoch: int) -> bool:
        """Whether every rank trains `epoch`: within the count, and under a budget with room
        for it, as rank 0 decides (its clock), so that all stop together."""
        if epoch > self.total():
            return False
        if not self.budget:
            return True
        progress = self.progress
        go_on = room_for_another(self.budget, progress.seconds_used, progress.slowest_train) if self.ctx.is_main else None
        if broadcast_object(go_on, self.ctx):
            return True
        why = ("before the resume; a larger --time-budget gives the run more time" if epoch == self.resumed_at > 1
               else "the epochs ran slower than epoch 1")
        self.ctx.print0(f"time budget: {progress.seconds_used:.1f}s of --time-budget {self.args.time_budget} used and "
                        f"an epoch's training takes up to {progress.slowest_train:.1f}s: ending after epoch "
                        f"{epoch - 1} of {self.total()} ({why})")
        return False

    def known_to_follow(self, epoch: int) -> bool:
        """Whether an epoch is sure to follow `epoch` (the guard aside), so that its pass may begin
        now: not while the budget has yet to fix the count."""
        return epoch < self.total() and bool(self.progress.budget_epochs or not self.budget)

    def timed(self, took: EpochTime, steps_before: int, training: Training) -> Training:
        """After an epoch: under a budget not yet fixed, the count that epoch 1's time gives
        (a resumed epoch 1's rest scaled to the whole epoch), and `training` fitted to it."""
        if not self.budget or self.progress.budget_epochs is not None:
            return training
        whole = EpochTime(took.train * (1 + steps_before / max(1, len(self.train_loader))), took.eval)
        fit = None
        if self.ctx.is_main:
            fit = epochs_that_fit(self.budget, whole, most_epochs(self.args), lambda n: run_sizes(self.args, n))
            print(budget_message(self.args, fit, whole), flush=True)
        self.progress.budget_epochs = broadcast_object(fit, self.ctx)
        return self.sized_to(self.progress.budget_epochs, training)

    def sized_to(self, epochs: int, training: Training) -> Training:
        """`training` with its learning-rate decay, and the loader with its crop sizes, fitted to
        a run of `epochs` epochs; config.json records the count."""
        self.train_loader.sampler.sizes = run_sizes(self.args, epochs)
        if self.ctx.is_main:
            record_budget_epochs(self.output_dir, epochs)
        return dataclasses.replace(training, schedule=build_schedule(self.args, training.schedule.peak,
                                                                     training.steps_per_epoch, epochs))


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """An epoch's evaluation: the metrics (the weight average's as ema_*), which weights
    scored higher ("model" or "ema"), their outputs, and their recomputed BatchNorm statistics
    (--bn-recalibrate; else None)."""

    val: dict[str, float]
    better: str
    outputs: Outputs
    evaluated_bn: dict[str, torch.Tensor] | None


def evaluate_epoch(training: Training, passes: EpochPasses, recalibrate: BatchNormRecalibration | None,
                   ctx: DistContext) -> Evaluation:
    """The model's validation metrics, and its weight average's when there is one, each
    evaluated as `recalibrate` prepares it. BatchNorm statistics come from rank 0 first:
    every rank then evaluates the same weights."""
    modules = {"model": training.placed.module, **({"ema": training.ema.module} if training.ema else {})}
    done = {}
    for name, module in modules.items():
        broadcast_buffers(module, ctx)
        placed = dataclasses.replace(training.placed, module=module)
        if recalibrate:
            placed = recalibrate(placed, ctx)
        outputs = validation_outputs(placed, passes.val())
        done[name] = (validation_metrics(outputs, ctx), outputs, placed.module)
    val = dict(done["model"][0])
    if "ema" in done:
        val.update({f"ema_{k}": v for k, v in done["ema"][0].items()})
    better = "ema" if "ema" in done and done["ema"][0]["val_acc"] > val["val_acc"] else "model"
    _, outputs, module = done[better]
    return Evaluation(val, better, outputs, batch_norm_statistics(module) if recalibrate else None)


def train_or_stop(training: Training, passes: EpochPasses, epoch: int, epochs: int, progress: Progress,
                  args: argparse.Namespace, split: DataSplit, output_dir: Path, files: EpochWriter | None,
                  ctx: DistContext) -> dict[str, float]:
    """One training epoch, or what a stopped run left of it. On SIGTERM every process stops at
    the same step, rank 0 saves that position, and the run ends with Preempted."""
    batches = passes.train(epoch, skip=progress.steps_in_epoch * args.batch_size)
    try:
        return train_one_epoch(training, batches, ctx, epoch, epochs, progress.steps_in_epoch, progress.epoch_sums)
    except StoppedInEpoch as stop:
        if files:
            stopped = dataclasses.replace(progress, epoch=epoch - 1, steps_in_epoch=stop.steps_done,
                                          epoch_sums=tuple(stop.sums))
            files.save_position(checkpoint_of(training, stopped, args, split, ctx))
        barrier(ctx)  # no process exits (and no launcher ends the job) before last.pth is on disk
        raise Preempted(f"SIGTERM: every process stopped after step {stop.steps_done} of epoch {epoch}; "
                        f"{output_dir / LAST} holds the position: resume with --resume auto") from None


def checkpoint_of(training: Training, progress: Progress, args: argparse.Namespace, split: DataSplit,
                  ctx: DistContext, evaluated: Evaluation | None = None) -> dict[str, Any]:
    """What the run has come to; `evaluated`: its last epoch's evaluation (none inside an epoch)."""
    return make_checkpoint(training.placed.module, training.optimizer, training.scaler, progress, args,
                           split.class_names, ctx.world_size, training.ema.module if training.ema else None,
                           evaluated.better if evaluated else "model", evaluated.evaluated_bn if evaluated else None)


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
