"""How far a run has come: the epochs done, the best accuracy, the position inside an epoch that
SIGTERM stopped, and what --time-budget has used and fixed, all of which a checkpoint records;
and, before each epoch, whether the time budget lets the run go on."""
from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

from multi_train_utils.distributed_utils import DistContext, broadcast_object
from recipe.budget import (
    EpochTime,
    budget_message,
    budget_seconds,
    epochs_that_fit,
    most_epochs,
    room_for_another,
    run_sizes,
)
from utils import CONFIG_FILE, read_json, write_json


@dataclasses.dataclass
class Progress:
    """How far a run has come: what a checkpoint records beyond the weights and optimizer."""

    epoch: int = 0  # epochs completed
    best_acc: float = -1.0
    # A run stopped inside epoch `epoch + 1` (SIGTERM): the batches each process had trained on
    # in it (always whole optimizer steps), its training sums so far (loss, correct, images) over
    # all processes, and its seconds of training so far (--time-budget counts them).
    steps_in_epoch: int = 0
    epoch_sums: tuple[float, float, float] = (0.0, 0.0, 0.0)
    epoch_seconds: float = 0.0
    # The epochs the run trains in all, as --time-budget fixed them from epoch 1's time; None: --epochs.
    budget_epochs: int | None = None
    # Seconds of training and evaluation in the finished epochs, and the longest training of
    # one: a resumed run spends what is left of --time-budget, not the whole of it again.
    seconds_used: float = 0.0
    slowest_train: float = 0.0
    # Epoch 1's seconds of training (before and after a stop, where a resume split it) and of
    # evaluation: --time-budget's count follows from them.
    first_epoch: tuple[float, float] | None = None
    # The last epoch the run trains, unless --time-budget ends it sooner, and the first this
    # process trains (neither saved: --epochs or the budget's count gives the one, the other
    # follows `epoch`).
    last_epoch: int = 0
    resumed_at: int = 1

    def finish_epoch(self, epoch: int, val_acc: float, train_stats: dict[str, Any], eval_seconds: float) -> None:
        """Note a finished epoch: its accuracy, and how long it took (train_one_epoch's
        `seconds`, after those trained before a stop inside it)."""
        train_seconds = self.epoch_seconds + train_stats["seconds"]
        if epoch == 1:
            self.first_epoch = (train_seconds, eval_seconds)
        self.epoch, self.steps_in_epoch, self.epoch_sums, self.epoch_seconds = epoch, 0, (0.0, 0.0, 0.0), 0.0
        self.seconds_used += train_seconds + eval_seconds
        self.slowest_train = max(self.slowest_train, train_seconds)
        self.best_acc = max(self.best_acc, val_acc)

    def fit_epochs_to_budget(self, args: argparse.Namespace, train_loader: Any, output_dir: Path,
                             ctx: DistContext) -> None:
        """--time-budget, before each epoch: once epoch 1 has run, its time fixes the count of
        epochs, once (rank 0's clock: one decision for every rank, kept in the progress and so in
        every later checkpoint, and in config.json, which rank 0 rewrites). The crop sizes of
        progressive resizing (`train_loader`'s keys carry them to the workers) and the learning
        rate's decay (train_one_epoch reads `budget_epochs`) follow the count, set here. Collective:
        a broadcast of rank 0's count, once."""
        if self.budget_epochs is None and self.first_epoch is not None:
            fit, first = None, EpochTime(*self.first_epoch)
            if ctx.is_main:
                fit = epochs_that_fit(budget_seconds(args), first, most_epochs(args), lambda n: run_sizes(args, n))
                print(budget_message(args, fit, first), flush=True)
                write_json(output_dir / CONFIG_FILE, {**read_json(output_dir / CONFIG_FILE), "budget_epochs": fit})
            self.budget_epochs = self.last_epoch = broadcast_object(fit, ctx)
        if self.budget_epochs is not None:
            train_loader.sampler.sizes = run_sizes(args, self.budget_epochs)

    def budget_allows(self, epoch: int, args: argparse.Namespace, ctx: DistContext) -> bool:
        """--time-budget, before epoch `epoch`: whether it runs, on every rank. It does not when it
        is past the count of epochs that fit, or when its training would not fit in what is left
        (rank 0 then says why). Collective: a broadcast of rank 0's verdict."""
        if self.budget_epochs is not None and epoch > self.budget_epochs:
            return False
        go_on = room_for_another(budget_seconds(args), self.seconds_used, self.slowest_train) if ctx.is_main else None
        if broadcast_object(go_on, ctx):
            return True
        why = ("before the resume; a larger --time-budget gives the run more time" if epoch == self.resumed_at > 1
               else "the epochs ran slower than epoch 1")
        ctx.print0(f"time budget: {self.seconds_used:.1f}s of --time-budget {args.time_budget} used and an epoch's "
                   f"training takes up to {self.slowest_train:.1f}s: ending after epoch {epoch - 1} of "
                   f"{self.last_epoch} ({why})")
        return False


def progress_of(checkpoint: dict[str, Any]) -> Progress:
    """How far the run that saved `checkpoint` had come."""
    first = checkpoint.get("first_epoch")
    return Progress(checkpoint["epoch"], checkpoint["best_acc"], checkpoint.get("steps_in_epoch", 0),
                    tuple(checkpoint.get("epoch_sums", (0.0, 0.0, 0.0))), checkpoint.get("epoch_seconds", 0.0),
                    checkpoint.get("budget_epochs"),
                    checkpoint.get("seconds_used", 0.0), checkpoint.get("slowest_train", 0.0),
                    tuple(first) if first else None)
