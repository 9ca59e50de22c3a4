"""How many epochs a run trains, and the run's stopwatch. --epochs decides, or under
--time-budget epoch 1's time fixes the count once (rank 0's clock, one decision for all ranks,
recorded in the progress and so in every checkpoint), and before each later epoch a guard ends
the run when that epoch's training would not fit in what is left. Whenever the count is fixed,
the learning-rate decay and the crop sizes are fitted to it."""
from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path

from torch.utils.data import DataLoader

from multi_train_utils.budget import (
    EpochTime,
    budget_message,
    budget_seconds,
    epochs_that_fit,
    most_epochs,
    room_for_another,
    run_sizes,
)
from multi_train_utils.checkpoint import Progress
from multi_train_utils.device_augment import DeviceAugmentedLoader
from multi_train_utils.distributed_utils import DistContext, broadcast_object
from multi_train_utils.run_folder import record_budget_epochs
from multi_train_utils.schedule import build_schedule
from multi_train_utils.train_eval_utils import Training

# The run's stopwatch, which --time-budget counts by; tests replace it to fake slow epochs.
clock = time.perf_counter


class RunTimes:
    """The run's `time:` line: start-up, epochs, final report."""

    def __init__(self) -> None:
        self.started = clock()

    def epochs_begin(self) -> None:
        self.epochs_started = clock()

    def epochs_end(self) -> None:
        self.epochs_ended = clock()

    def reported(self) -> None:
        self.report_done = clock()

    def line(self, extra: str = "") -> str:
        return (f"time: start-up {self.epochs_started - self.started:.1f}s, epochs "
                f"{self.epochs_ended - self.epochs_started:.1f}s, final report {self.report_done - self.epochs_ended:.1f}s"
                + (f", {extra}" if extra else ""))


class EpochCount:
    """The epochs of the run, iterated from where `progress` stands, each timed: training
    (start to `trained()`) and evaluation (to `evaluated()`)."""

    def __init__(self, args: argparse.Namespace, progress: Progress, train_loader: DataLoader | DeviceAugmentedLoader,
                 output_dir: Path, ctx: DistContext):
        self.args, self.progress, self.train_loader, self.output_dir, self.ctx = args, progress, train_loader, output_dir, ctx
        self.budget = budget_seconds(args)
        self.resumed_at = progress.epoch + 1

    def __iter__(self) -> Iterator[int]:
        self.ctx.print0(f"training: epoch {self.resumed_at} of {self.shown()}, "
                        f"{len(self.train_loader)} batches per process")
        epoch = self.resumed_at
        while self.starts(epoch):
            self.steps_before = self.progress.steps_in_epoch
            self.started = clock()
            yield epoch
            epoch += 1

    def trained(self) -> None:
        self.train_ended = clock()

    def evaluated(self) -> EpochTime:
        return EpochTime(self.train_ended - self.started, clock() - self.train_ended)

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

    def next_after(self, epoch: int) -> int | None:
        """The epoch sure to follow `epoch` (the guard aside), so that its pass may begin now;
        None at the end, and while the budget has yet to fix the count."""
        sure = epoch < self.total() and bool(self.progress.budget_epochs or not self.budget)
        return epoch + 1 if sure else None

    def timed(self, took: EpochTime, training: Training) -> Training:
        """After an epoch: under a budget not yet fixed, the count that epoch 1's time gives
        (a resumed epoch 1's rest scaled to the whole epoch), and `training` fitted to it."""
        if not self.budget or self.progress.budget_epochs is not None:
            return training
        whole = EpochTime(took.train * (1 + self.steps_before / max(1, len(self.train_loader))), took.eval)
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
