"""--time-budget: how long a run may train, and how many epochs fit in it.

The run times its first epoch (training and evaluation), fixes from it the number of epochs
that fit, once, and sizes the learning-rate decay and progressive resizing to that number.
The first epoch is warm-up, the same whatever the number. A run whose epochs turn out slower
than the first one promised ends at an epoch boundary before the budget runs out. The budget
is the run's, not the process's: a resumed run spends what its earlier epochs left of it.
"""
from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from multi_train_utils.config import BUDGET_MOST_EPOCHS, DEFAULT_EPOCHS, budget_seconds
from multi_train_utils.distributed_utils import DistContext, broadcast_object
from multi_train_utils.train_eval_utils import Progress
from my_dataset import SizeSchedule, size_schedule
from utils import CONFIG_FILE, read_json, write_json


def planned_epochs(args: argparse.Namespace) -> int:
    """The epochs the run is drawn for before a budget fixes a count: --epochs, else 30."""
    return args.epochs or DEFAULT_EPOCHS


def most_epochs(args: argparse.Namespace) -> int:
    """The most epochs the run may train: --epochs when given, else 30, or 1000 under a budget."""
    return args.epochs or (DEFAULT_EPOCHS if args.time_budget is None else BUDGET_MOST_EPOCHS)


@dataclasses.dataclass(frozen=True)
class EpochTime:
    """Seconds an epoch took: training (at the crop size of that epoch) and evaluation."""

    train: float
    eval: float


def run_sizes(args: argparse.Namespace, epochs: int) -> SizeSchedule:
    """Progressive resizing for a run of `epochs` epochs: --ramp-epochs is read as its share of
    --epochs (of 30 when not given). The ramp ends at epoch 2 at the earliest, so epoch 1 keeps
    its crop."""
    ramp = args.ramp_epochs
    if ramp >= 2:
        ramp = max(2, round(ramp * epochs / planned_epochs(args)))
    return size_schedule({**vars(args), "ramp_epochs": ramp})


def epochs_that_fit(seconds: float, first: EpochTime, most: int, sizes: Callable[[int], SizeSchedule],
                    headroom: float = 0.05) -> int:
    """The most epochs, up to `most` and at least 1, whose training and evaluation fit in
    `seconds` less the headroom, the first epoch having taken `first`. An epoch's training time
    grows with the pixels of its crop (`sizes(n)`: the crop sizes of an n-epoch run); evaluation's
    does not. The headroom: epochs vary by about a tenth around epoch 1's time, and the guard ends
    a run whose next epoch might not fit; counted to the full budget, that cut off the last epoch,
    where the learning rate ends, in 4 of 18 measured runs."""
    seconds *= 1 - headroom

    def cost(n: int) -> float:
        crop = sizes(n)
        return sum(first.train * (crop(e) / crop(1)) ** 2 + first.eval for e in range(1, n + 1))

    # No epoch is cheaper than epoch 1 (the crop only grows), which bounds the count. Not quite
    # monotonic in n below that (the ramp's rounding): look at every n.
    bound = int(seconds / max(first.train + first.eval, 1e-9))
    return max((n for n in range(1, min(bound, most) + 1) if cost(n) <= seconds), default=1)


def budget_message(args: argparse.Namespace, fit: int, first: EpochTime) -> str:
    """What the run says when it fixes its epoch count: how many, and which limit decided."""
    took = f"epoch 1 took {first.train + first.eval:.1f}s ({first.train:.1f}s training, {first.eval:.1f}s evaluation)"
    most, budget = most_epochs(args), args.time_budget
    if fit >= most:
        limit = f"--epochs {most}" if args.epochs else f"{most} epochs, the most a budget alone trains,"
        return f"time budget: {took}; {limit} is the smaller limit: training {most} epochs"
    if fit == 1:
        return f"time budget: {took}; --time-budget {budget} has room for that epoch only: training 1 epoch"
    fewer = f", fewer than --epochs {most}" if args.epochs else ""
    return f"time budget: {took}; --time-budget {budget} fits {fit} epochs{fewer}: training {fit}"


def room_for_another(seconds: float, used: float, slowest_train: float) -> bool:
    """The budget's guard, counting the seconds of training and evaluation: an epoch starts
    only when its training, as long as the slowest so far, ends within the budget (its
    evaluation may run past it)."""
    return used + slowest_train <= seconds


def next_epoch_fits(progress: Progress, epoch: int, train_loader: Any, output_dir: Path, args: argparse.Namespace,
                    ctx: DistContext) -> bool:
    """Before epoch `epoch`: once epoch 1 has run, its time fixes the count of epochs, once (rank
    0's clock: one decision for every rank, kept in the progress and so in every later checkpoint,
    and in config.json); the crops of progressive resizing (`train_loader`'s keys carry them to
    the workers) and the learning rate's decay follow the count. Then whether this epoch runs: not
    past the count, nor when its training would not fit in what is left (rank 0 says why).
    Collectives: a broadcast of rank 0's count, once; a broadcast of rank 0's verdict."""
    if progress.budget_epochs is None and progress.first_epoch is not None:
        fit, first = None, EpochTime(*progress.first_epoch)
        if ctx.is_main:
            fit = epochs_that_fit(budget_seconds(args), first, most_epochs(args), lambda n: run_sizes(args, n))
            print(budget_message(args, fit, first), flush=True)
            write_json(output_dir / CONFIG_FILE, {**read_json(output_dir / CONFIG_FILE), "budget_epochs": fit})
        progress.budget_epochs = progress.last_epoch = broadcast_object(fit, ctx)
    if progress.budget_epochs is not None:
        train_loader.sampler.sizes = run_sizes(args, progress.budget_epochs)
        if epoch > progress.budget_epochs:
            return False
    go_on = room_for_another(budget_seconds(args), progress.seconds_used, progress.slowest_train) if ctx.is_main else None
    if broadcast_object(go_on, ctx):
        return True
    why = ("before the resume; a larger --time-budget gives the run more time" if epoch == progress.resumed_at > 1
           else "the epochs ran slower than epoch 1")
    ctx.print0(f"time budget: {progress.seconds_used:.1f}s of --time-budget {args.time_budget} used and an epoch's "
               f"training takes up to {progress.slowest_train:.1f}s: ending after epoch {epoch - 1} of "
               f"{progress.last_epoch} ({why})")
    return False
