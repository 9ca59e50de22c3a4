"""--time-budget: how long a run may train, and how many epochs fit in it.

The run times its first epoch (training and evaluation), fixes from it the number of epochs
that fit, once, and sizes the learning-rate decay and progressive resizing to that number.
The first epoch is warm-up, the same whatever the number. A run whose epochs turn out slower
than the first one promised ends at an epoch boundary before the budget runs out.
"""
from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Callable

from my_dataset import SizeSchedule, size_schedule
from utils import UserError

_SECONDS_PER = {"": 1, "s": 1, "m": 60, "h": 3600}


def parse_duration(text: str) -> float:
    """Seconds in `600`, `600s`, `10m` or `1.5h`."""
    match = re.fullmatch(r"(\d+\.?\d*|\.\d+)([smh]?)", text.strip())
    if not match or float(match[1]) == 0:
        raise UserError(f"--time-budget takes a positive duration such as 600 (seconds), 10m or 1.5h, not {text!r}")
    return float(match[1]) * _SECONDS_PER[match[2]]


def budget_seconds(args: argparse.Namespace) -> float | None:
    return None if args.time_budget is None else parse_duration(args.time_budget)


@dataclasses.dataclass(frozen=True)
class EpochTime:
    """Seconds an epoch took: training (at the crop size of that epoch) and evaluation."""

    train: float
    eval: float


def run_sizes(args: argparse.Namespace, epochs: int) -> SizeSchedule:
    """Progressive resizing for a run of `epochs` epochs: --ramp-epochs is read as its share of
    --epochs. The ramp ends at epoch 2 at the earliest, so epoch 1 keeps its crop."""
    ramp = args.ramp_epochs
    if ramp >= 2:
        ramp = max(2, round(ramp * epochs / args.epochs))
    return size_schedule({**vars(args), "ramp_epochs": ramp})


def epochs_that_fit(seconds: float, first: EpochTime, most: int, sizes: Callable[[int], SizeSchedule]) -> int:
    """The most epochs, up to `most` and at least 1, whose training and evaluation fit in
    `seconds`, the first epoch having taken `first`. An epoch's training time grows with the
    pixels of its crop (`sizes(n)`: the crop sizes of an n-epoch run); evaluation's does not."""

    def cost(n: int) -> float:
        crop = sizes(n)
        return sum(first.train * (crop(e) / crop(1)) ** 2 + first.eval for e in range(1, n + 1))

    # Not quite monotonic in n (the ramp's rounding): look at every n.
    return max((n for n in range(1, most + 1) if cost(n) <= seconds), default=1)


def budget_message(budget: str, fit: int, most: int, first: EpochTime) -> str:
    """What the run says when it fixes its epoch count: how many, and which limit decided."""
    took = f"epoch 1 took {first.train + first.eval:.1f}s ({first.train:.1f}s training, {first.eval:.1f}s evaluation)"
    if fit >= most:
        return f"time budget: {took}; --epochs {most} is the smaller limit: training {most} epochs"
    if fit == 1:
        return f"time budget: {took}; --time-budget {budget} has room for that epoch only: training 1 epoch"
    return f"time budget: {took}; --time-budget {budget} fits {fit} epochs, fewer than --epochs {most}: training {fit}"


@dataclasses.dataclass
class Deadline:
    """The budget's guard, counting the seconds of training and evaluation: an epoch starts
    only when its training, as long as the slowest so far, ends within the budget (its
    evaluation may run past it)."""

    seconds: float
    used: float = 0.0
    slowest_train: float = 0.0

    def note(self, epoch: EpochTime) -> None:
        self.used += epoch.train + epoch.eval
        self.slowest_train = max(self.slowest_train, epoch.train)

    def room_for_another(self) -> bool:
        return self.used + self.slowest_train <= self.seconds
