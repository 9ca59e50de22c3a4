"""The learning rate: the linear scaling rule for the peak, and a schedule that is a function of
the optimizer step alone (warm-up, then a cosine or linear decay), so a resumed run at any world
size computes it afresh and nothing of it is saved."""
from __future__ import annotations

import argparse
import dataclasses
import math

from multi_train_utils.distributed_utils import DistContext
from recipe.budget import planned_epochs


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Linear warm-up to the peak, held there until `decay_from` (under a budget, the end of
    epoch 1: the decay's length is not known before), then a decay to `final_fraction` of the
    peak by the last step: a cosine, or a straight line. The learning rate is a function of the
    step alone: a resumed run at any world size computes it afresh."""

    peak: float
    total_steps: int
    warmup_steps: int
    final_fraction: float
    decay: str = "cosine"
    decay_from: int = 0

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.peak * (step + 1) / (self.warmup_steps + 1)
        start = max(self.warmup_steps, self.decay_from)
        progress = min(1.0, max(0, step - start) / max(1, self.total_steps - start))
        falls = 1 - progress if self.decay == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
        return self.peak * (self.final_fraction + (1 - self.final_fraction) * falls)


def build_schedule(args: argparse.Namespace, peak: float, steps_per_epoch: int, epochs: int | None = None) -> Schedule:
    """`epochs`: the count --time-budget fixed after epoch 1 (default --epochs, or 30). Epoch 1
    runs before that count is known, so under a budget the decay starts at epoch 2 at the
    earliest (a shorter warm-up holds the peak until then): epoch 1 is the same whatever the
    count."""
    total = max(1, (epochs or planned_epochs(args)) * steps_per_epoch)
    warmup = round(args.warmup_epochs * steps_per_epoch)
    if args.time_budget is None:
        return Schedule(peak, total, min(total - 1, warmup), args.lrf, args.lr_decay)
    return Schedule(peak, total, warmup, args.lrf, args.lr_decay, decay_from=steps_per_epoch)


def global_batch(args: argparse.Namespace, ctx: DistContext) -> int:
    """Images per optimizer step: the batch of every process, times the batches accumulated."""
    return args.batch_size * ctx.world_size * args.accum_steps


def peak_lr(args: argparse.Namespace, ctx: DistContext) -> float:
    """The linear scaling rule: `--lr` is per 256 images of global batch."""
    return args.lr * global_batch(args, ctx) / 256


