"""--resume: the checkpoint a run goes on from, its weights put back into the model, and the
optimizer, loss scaler, weight average and progress put back into the training."""
from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

from torch import nn

from multi_train_utils.checkpoint import Progress, load_checkpoint, restore_progress, restore_weights
from multi_train_utils.config import Plan
from multi_train_utils.distributed_utils import DistContext, broadcast_object
from multi_train_utils.run_folder import LAST
from multi_train_utils.train_eval_utils import Training
from utils import DataSplit


@dataclasses.dataclass
class ResumePoint:
    """The checkpoint a run resumes from (`path` None: a new run), loaded once."""

    path: str | None = None
    checkpoint: dict[str, Any] | None = None

    def num_classes(self, plan: Plan) -> int:
        """The model's class count, known before the split: the checkpoint's, else the folder's
        (leaving out unreadable files never empties a class: that is an error)."""
        return len(self.checkpoint["class_names"] if self.checkpoint is not None else plan.class_names)

    def restore_weights(self, model: nn.Module, split: DataSplit, args: argparse.Namespace) -> None:
        """The checkpoint's weights in `model` (its shipped ones under --eval-only), checked
        against the data's classes and the model asked for."""
        if self.checkpoint is not None:
            restore_weights(self.checkpoint, model, args, split.class_names, self.path)

    def restore(self, training: Training, args: argparse.Namespace, lost_files: bool, ctx: DistContext) -> Progress:
        """Where the run stands: nowhere yet, or where the checkpoint left it (the optimizer and
        the scaler restored). A position inside an epoch holds only for the same processes, batch
        and files: elsewhere that epoch starts over. The checkpoint is dropped afterwards: the
        optimizer state lives in the optimizer now, with no second copy."""
        checkpoint, self.checkpoint = self.checkpoint, None
        if checkpoint is None:
            return Progress()
        progress = restore_progress(checkpoint, training.optimizer, training.scaler,
                                    training.ema.module if training.ema else None)
        message = f"resumed from {self.path}: {progress.epoch} epoch(s) done, best val_acc {progress.best_acc:.4f}"
        if progress.steps_in_epoch:
            same_steps = (checkpoint["world_size"] == ctx.world_size
                          and checkpoint["args"]["batch_size"] == args.batch_size
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


def resume_point(plan: Plan, output_dir: Path, ctx: DistContext) -> ResumePoint:
    """--resume PATH, or for `auto` the folder's last.pth if any (rank 0 decides, so every rank
    makes the same choice even if a file appears meanwhile); loaded, or none."""
    path = plan.args.resume
    if path == "auto":
        found = (output_dir / LAST).is_file() if ctx.is_main else None
        path = str(output_dir / LAST) if broadcast_object(found, ctx) else None
    return ResumePoint(path, load_checkpoint(path) if path else None)
