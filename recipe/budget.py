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
import re
from collections.abc import Callable

from my_dataset import SizeSchedule, size_schedule
from utils import UserError

_SECONDS_PER = {"": 1, "s": 1, "m": 60, "h": 3600}

# --epochs when it is not given; with --time-budget alone, the budget decides, up to a limit
# that only tiny folders reach. The ramp of progressive resizing is read against the default.
DEFAULT_EPOCHS = 30
BUDGET_MOST_EPOCHS = 1000
# The count is what fits in 95% of the budget. Epochs vary by about a tenth around epoch 1's
# time, and the guard ends a run whose next epoch might not fit: counted to the full budget,
# that cut off the last epoch, where the learning rate ends, in 4 of 18 measured runs.
HEADROOM = 0.05


def parse_duration(text: str) -> float:
    """Seconds in `600`, `600s`, `10m` or `1.5h`."""
    match = re.fullmatch(r"(\d+\.?\d*|\.\d+)([smh]?)", text.strip())
    if not match or float(match[1]) == 0:
        raise UserError(f"--time-budget takes a positive duration such as 600 (seconds), 10m or 1.5h, not {text!r}")
    return float(match[1]) * _SECONDS_PER[match[2]]


def budget_seconds(args: argparse.Namespace) -> float | None:
    return None if args.time_budget is None else parse_duration(args.time_budget)


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


def epochs_that_fit(seconds: float, first: EpochTime, most: int, sizes: Callable[[int], SizeSchedule]) -> int:
    """The most epochs, up to `most` and at least 1, whose training and evaluation fit in
    `seconds` less the headroom, the first epoch having taken `first`. An epoch's training time
    grows with the pixels of its crop (`sizes(n)`: the crop sizes of an n-epoch run); evaluation's
    does not."""
    seconds *= 1 - HEADROOM

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

