"""--resume, and the split a run trains on when it is not simply --val-rate's draw of the folder:
a resumed run's recorded files (its split.json), or --check-images' readable ones.

A resumed run reads the checkpoint on every rank, keeps the files its split.json recorded (the
folder is not split again, whatever was added or removed since; the files are not decoded again,
only compared with their recorded size and time), and puts back the optimizer, the loss scaler
and the weight average; a run stopped inside an epoch goes on after the batches it trained."""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any

import torch

from multi_train_utils.checkpoint import LAST, check_architecture, check_classes, load_checkpoint
from multi_train_utils.config import Plan
from multi_train_utils.distributed_utils import DistContext, broadcast_object, gather_objects
from multi_train_utils.train_eval_utils import Progress
from utils import (METRICS_FILE, SPLIT_FILE, DataSplit, RecordedSplit, Sample, UserError, drop_unreadable, file_stamp,
                   find_unreadable, load_recorded_split, split_samples, write_text_atomic)


def read_checkpoint(args: argparse.Namespace, output_dir: Path, ctx: DistContext) -> dict[str, Any] | None:
    """The checkpoint the run goes on from (--resume PATH, or for `auto` the run folder's last.pth
    if rank 0 finds one), read by every rank itself (on several machines: from a shared file
    system); None for a new run. Collectives: under --resume auto, a broadcast of whether rank 0
    found last.pth, so that every rank reads it, or none; then an all_gather of what each rank
    read, or why it could not: a lagging shared file system may show one rank an older last.pth,
    or none, and ranks at different positions would hang, or silently train apart."""
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
    found = gather_objects((problem, checkpoint and (checkpoint["epoch"], checkpoint.get("steps_in_epoch", 0))), ctx)
    if failed := [(rank, why) for rank, (why, _) in enumerate(found) if why]:
        rank, why = failed[0]
        raise UserError(f"rank {rank}: {why}" if ctx.distributed else why)
    positions = [position for _, position in found]
    if len(set(positions)) > 1:
        seen = ", ".join(f"rank {r}: epoch {e} step {s}" for r, (e, s) in enumerate(positions))
        raise UserError(f"the ranks read different checkpoints from {path} ({seen}): a shared file system that "
                        "has not caught up? Start the job again once every node sees the same file")
    metrics = output_dir / METRICS_FILE
    if ctx.is_main and not args.eval_only and metrics.is_file():
        # The epochs the checkpoint holds keep their lines: those after it are trained again.
        lines = [line for line in metrics.read_text().splitlines() if _epoch_of(line) <= checkpoint["epoch"]]
        write_text_atomic(metrics, "".join(line + "\n" for line in lines))
    if args.eval_only:  # the weights are evaluated as they were trained to be
        trained = {k: checkpoint["args"].get(k) for k in ("img_size", "val_img_size")}
        if trained != {k: getattr(args, k) for k in trained}:
            ctx.print0(f"--eval-only: {path} was trained with --img-size {trained['img_size']}"
                       + (f" --val-img-size {trained['val_img_size']}" if trained["val_img_size"] else "")
                       + ": evaluating at that size")
            vars(args).update(trained)
    return {**checkpoint, "loaded_from": path}


def checked_split(plan: Plan, checkpoint: dict[str, Any] | None, ctx: DistContext) -> tuple[DataSplit, str, bool]:
    """The run's split, the folder its files are under, and whether a resumed run goes on without
    some of its recorded files. A resumed run's, and --eval-only's of a run's checkpoint, is the one
    its split.json recorded beside the checkpoint (recorded_files); a new run's under
    --check-images, the folder's files that decode (readable_split). Collectives: resumed, a
    broadcast of whether rank 0 sees the record, then of rank 0's verdict on the recorded files;
    else an all_gather of the files each rank could not decode."""
    args, root, dropped_some_files = plan.args, plan.args.data_path, False
    path = checkpoint["loaded_from"] if checkpoint is not None else None
    recorded = Path(path).parent / SPLIT_FILE if path else None
    # broadcast: rank 0's view of the folder decides which collective every rank makes next (a node-local copy
    # of a run folder, or a lagging network file system, may show each rank another).
    if recorded is not None and broadcast_object(recorded.is_file() if ctx.is_main else None, ctx):
        verdict = broadcast_object(_recorded_or_error(plan, recorded) if ctx.is_main else None, ctx)
        if isinstance(verdict, str):
            raise UserError(verdict)
        (split, root, dropped_some_files), lines = verdict
        for line in lines:
            ctx.print0(line)
    else:
        if recorded is not None:
            ctx.print0(f"warning: {recorded} does not exist (a run folder from before runs recorded their files): "
                       f"{args.data_path} is listed and split again, and files added or removed since the run "
                       "started change its split")
        split = readable_split(plan, ctx) if args.check_images else split_samples(
            plan.samples, plan.class_names, args.val_rate, args.seed, plan.val_files)
    if checkpoint is not None:
        check_classes(checkpoint, split.class_names, path)
    return split, root, dropped_some_files


def _recorded_or_error(plan: Plan, recorded: Path) -> tuple[tuple[DataSplit, str, bool], list[str]] | str:
    try:
        return recorded_files(plan, load_recorded_split(recorded), recorded)
    except UserError as e:
        return str(e)


def recorded_files(plan: Plan, record: RecordedSplit, source: Path) -> tuple[tuple[DataSplit, str, bool], list[str]]:
    """The recorded split, checked: every file still there with its recorded size and time
    (a changed one must still decode), and what to say about it. Files gone or unreadable are
    an error, or with --drop-missing left out; files added to the folder since are not used."""
    args, split, lines = plan.args, record.split, []
    root = record.data_path or args.data_path
    if args.data_moved:
        split = _moved(split, root, args.data_path)
        lines.append(f"{source}: the run's files are read under {args.data_path}, where they moved from {root}")
        root = args.data_path
    moved_hint = ""
    if not args.data_moved and os.path.abspath(args.data_path) != os.path.abspath(root):
        moved_hint = f"; if they moved to {args.data_path}, add --data-moved"
        lines.append(f"{source}: the run's files under {root} are used, not --data-path {args.data_path} "
                     "(if they moved there, add --data-moved)")
    files = [p for p, _ in split.train + split.val]
    stamps = record.stamps or [None] * len(files)
    now = [file_stamp(p) for p in files]
    gone = [p for p, stamp in zip(files, now) if stamp is None]
    changed = [p for p, then, stamp in zip(files, stamps, now) if then is not None and stamp not in (None, then)]
    bad = gone + [p for p, _ in find_unreadable(changed, threads=os.cpu_count() or 1)]
    if bad and not args.drop_missing:
        shown = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
        raise UserError(f"{len(bad)} of the run's {len(files)} files are gone or no longer decode ({shown}); "
                        f"{source} is the run's split: restore them, or resume with --drop-missing to go on without "
                        f"them{moved_hint}")
    if bad:
        left_out = set(bad)
        split = dataclasses.replace(split, train=[s for s in split.train if s[0] not in left_out],
                                    val=[s for s in split.val if s[0] not in left_out])
        lines.append(f"--drop-missing: left out {len(record.split.train) - len(split.train)} training and "
                     f"{len(record.split.val) - len(split.val)} validation image(s) that are gone or no longer decode")
    same_folder = os.path.abspath(root) == os.path.abspath(args.data_path)
    new = len({os.path.abspath(p) for p, _ in plan.samples} - {os.path.abspath(p) for p in files}) if same_folder else 0
    if new:
        lines.append(f"{new} image(s) added to {args.data_path} since the run started are not used: to train on them, "
                     "start a new run (another --output-dir, without --resume)")
    return (split, root, bool(bad)), lines


def _moved(split: DataSplit, old_root: str, new_root: str) -> DataSplit:
    """The split's files, each at the same place under `new_root` as it was under `old_root`."""
    def move(samples: list[Sample]) -> list[Sample]:
        return [(os.path.join(new_root, os.path.relpath(p, old_root)), label) for p, label in samples]

    return dataclasses.replace(split, train=move(split.train), val=move(split.val))


def readable_split(plan: Plan, ctx: DistContext) -> DataSplit:
    """--check-images: leave out the files that do not decode, then split. Each rank decodes
    1/world_size of the files, with a thread per CPU of its own, and the ranks swap their
    findings, so that every rank ends with the same split. Collective: an all_gather."""
    paths = [p for p, _ in plan.samples]
    mine = find_unreadable(paths[ctx.rank :: ctx.world_size], threads=ctx.cpus)
    unreadable = dict(pair for part in gather_objects(mine, ctx) for pair in part)
    for path, reason in sorted(unreadable.items()):
        ctx.print0(f"warning: leaving out {path}: {reason}")
    samples = drop_unreadable(plan.samples, plan.class_names, unreadable)
    return split_samples(samples, plan.class_names, plan.args.val_rate, plan.args.seed, plan.val_files)


def restore_training(checkpoint: dict[str, Any], progress: Progress, optimizer: torch.optim.Optimizer,
                     scaler: torch.amp.GradScaler, extra: Any, train_loader: Any, dropped_some_files: bool,
                     args: argparse.Namespace, ctx: DistContext) -> Progress:
    """Where the run stands: where `checkpoint` left it, its optimizer, scaler and weight-average
    state put back (every rank the same: the copies stay identical). A position inside an epoch
    holds only for the same processes, batch and files (`dropped_some_files`: --drop-missing left
    some out): there the epoch's pass begins after the batches trained (`train_loader`'s sampler
    skips them), elsewhere that epoch starts over. The learning rate is not taken from the
    optimizer's state: train_one_epoch sets it from the step."""
    optimizer.load_state_dict(checkpoint["optimizer"])
    lay_out_momentum_as_parameters(optimizer)
    if checkpoint["scaler"]:  # empty from a run without fp16's loss scaling: this run's scale starts afresh
        scaler.load_state_dict(checkpoint["scaler"])  # a no-op where this run has none
    if extra.ema is not None:  # a run that turns --ema on when it resumes starts the average from the weights
        extra.ema.module.load_state_dict(checkpoint.get("ema", checkpoint["model"]))
    first = checkpoint.get("first_epoch")
    progress = dataclasses.replace(
        progress, epoch=checkpoint["epoch"], best_acc=checkpoint["best_acc"],
        steps_in_epoch=checkpoint.get("steps_in_epoch", 0), epoch_sums=tuple(checkpoint.get("epoch_sums", (0.0,) * 3)),
        epoch_seconds=checkpoint.get("epoch_seconds", 0.0), budget_epochs=checkpoint.get("budget_epochs"),
        seconds_used=checkpoint.get("seconds_used", 0.0), slowest_train=checkpoint.get("slowest_train", 0.0),
        first_epoch=tuple(first) if first else None, resumed_at=checkpoint["epoch"] + 1)
    if progress.budget_epochs:
        progress.last_epoch = progress.budget_epochs
    message = (f"resumed from {checkpoint['loaded_from']}: {progress.epoch} epoch(s) done, best val_acc "
               f"{progress.best_acc:.4f}")
    if progress.steps_in_epoch:
        same_steps = (checkpoint["world_size"] == ctx.world_size and checkpoint["args"]["batch_size"] == args.batch_size
                      and checkpoint["args"].get("accum_steps", 1) == args.accum_steps)
        if same_steps and not dropped_some_files:
            message += f"; epoch {progress.epoch + 1} goes on after step {progress.steps_in_epoch}"
            train_loader.sampler.skip_next_pass(progress.steps_in_epoch * args.batch_size)
        else:
            why = (", whose order of images held the files left out" if dropped_some_files else
                   f" with {checkpoint['world_size']} process(es) of batch {checkpoint['args']['batch_size']}")
            message += f"; it stopped inside epoch {progress.epoch + 1}{why}, so that epoch starts over"
            # The stopped part's time was spent all the same: --time-budget counts it as used.
            progress = dataclasses.replace(progress, steps_in_epoch=0, epoch_sums=(0.0, 0.0, 0.0), epoch_seconds=0.0,
                                           seconds_used=progress.seconds_used + progress.epoch_seconds)
    ctx.print0(message)
    return progress


def _epoch_of(line: str) -> float:
    try:
        return json.loads(line)["epoch"]
    except (ValueError, KeyError, TypeError):  # a line cut short by a kill mid-append
        return math.inf


def lay_out_momentum_as_parameters(optimizer: torch.optim.Optimizer) -> None:
    """Each momentum buffer in its parameter's memory layout. A checkpoint holds each buffer in
    the layout of the run that saved it; loading keeps the file's layout, which differs from this
    run's parameters under the other --channels-last. The fused step reads a parameter, its
    gradient and its buffer as one flat array each: CUDA's refuses buffers laid out otherwise,
    the CPU's silently mixes up their elements."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state.get(param, {})
            buffer = state.get("momentum_buffer")
            if buffer is not None and buffer.stride() != param.stride():
                state["momentum_buffer"] = torch.empty_like(param).copy_(buffer)  # the same values, re-laid
