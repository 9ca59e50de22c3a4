"""--resume: where a run stands. The optimizer, the loss scaler and the weight average are put
back from the checkpoint; a run stopped inside an epoch goes on after the batches it trained."""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import torch

from multi_train_utils.distributed_utils import DistContext
from multi_train_utils.progress import Progress, progress_of
from recipe.budget import budget_seconds, most_epochs
from recipe.ema import WeightAverage


def restore_training(checkpoint: dict[str, Any] | None, optimizer: torch.optim.Optimizer,
                     scaler: torch.amp.GradScaler, ema: WeightAverage | None, train_loader: Any, lost_files: bool,
                     args: argparse.Namespace, ctx: DistContext) -> Progress:
    """Where the run stands: nowhere yet, or where `checkpoint` left it, its optimizer, scaler and
    weight-average state put back (every rank the same: the copies stay identical). A position
    inside an epoch holds only for the same processes, batch and files (`lost_files`: some of
    the run's files were left out): there the epoch's pass begins after the batches trained
    (`train_loader`'s sampler skips them), elsewhere that epoch starts over. The learning rate
    is not taken from the optimizer state: train_one_epoch sets it from the step."""
    progress, skip = Progress(), 0
    if checkpoint is not None:
        optimizer.load_state_dict(checkpoint["optimizer"])
        lay_out_momentum_as_parameters(optimizer)
        if checkpoint["scaler"]:  # empty from a run without fp16's loss scaling: this run's scale starts afresh
            scaler.load_state_dict(checkpoint["scaler"])  # a no-op where this run has none
        if ema is not None:  # a run that turns --ema on when it resumes starts the average from the weights
            ema.module.load_state_dict(checkpoint.get("ema", checkpoint["model"]))
        progress = progress_of(checkpoint)
        message = (f"resumed from {checkpoint['loaded_from']}: {progress.epoch} epoch(s) done, best val_acc "
                   f"{progress.best_acc:.4f}")
        if progress.steps_in_epoch:
            same_steps = (checkpoint["world_size"] == ctx.world_size
                          and checkpoint["args"]["batch_size"] == args.batch_size
                          and checkpoint["args"].get("accum_steps", 1) == args.accum_steps)
            if same_steps and not lost_files:
                message += f"; epoch {progress.epoch + 1} goes on after step {progress.steps_in_epoch}"
                skip = progress.steps_in_epoch * args.batch_size
            else:
                why = (", whose order of images held the files left out" if lost_files else
                       f" with {checkpoint['world_size']} process(es) of batch {checkpoint['args']['batch_size']}")
                message += f"; it stopped inside epoch {progress.epoch + 1}{why}, so that epoch starts over"
                # The stopped part's time was spent all the same: --time-budget counts it as used.
                progress = dataclasses.replace(progress, steps_in_epoch=0, epoch_sums=(0.0, 0.0, 0.0), epoch_seconds=0.0,
                                               seconds_used=progress.seconds_used + progress.epoch_seconds)
        ctx.print0(message)
    progress.last_epoch = progress.budget_epochs or most_epochs(args)
    progress.resumed_at = progress.epoch + 1
    if progress.budget_epochs or budget_seconds(args) is None:
        count = str(progress.last_epoch)
    else:
        count = (f"as many as --time-budget {args.time_budget} fits (at most {progress.last_epoch}; counted after "
                 "this epoch)")
    ctx.print0(f"training: epoch {progress.epoch + 1} of {count}, {len(train_loader)} batches per process")
    if skip:
        train_loader.sampler.skip_next_pass(skip)
    return progress


def lay_out_momentum_as_parameters(optimizer: torch.optim.Optimizer) -> None:
    """Each momentum buffer in its parameter's memory layout. A checkpoint holds each buffer in
    the layout of the run that saved it, except a GPU run's epoch checkpoints, whose pinned host
    copies are NCHW; loading keeps the file's layout, which differs from this run's parameters
    after a GPU's epoch or under the other --channels-last. The fused step reads a parameter,
    its gradient and its buffer as one flat array each: CUDA's refuses buffers laid out
    otherwise, the CPU's silently mixes up their elements."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state.get(param, {})
            buffer = state.get("momentum_buffer")
            if buffer is not None and buffer.stride() != param.stride():
                state["momentum_buffer"] = torch.empty_like(param).copy_(buffer)  # the same values, re-laid
