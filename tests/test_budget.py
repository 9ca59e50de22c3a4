"""--time-budget: the duration it takes, the epoch count it derives from a timed epoch 1 (the
epochs' durations are set in-process, nothing sleeps), and the count a resumed run keeps."""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable

import pytest
import torch
from conftest import FAST, SMALL_MODEL, args_for, call_main, copy_sample, metrics, user_error

import train_single_gpu
from multi_train_utils.config import parse_duration
from multi_train_utils.distributed_utils import DistContext
from multi_train_utils.train_eval_utils import learning_rate
from recipe.budget import EpochTime, budget_message, epochs_that_fit, most_epochs, run_sizes


def test_durations():
    assert parse_duration("600") == 600 and parse_duration("45s") == 45
    assert parse_duration("10m") == 600 and parse_duration("1.5h") == 5400


@pytest.mark.parametrize("value", ["0", "-5", "10x", "1.5.h", ""])
def test_bad_budgets_are_one_line_and_exit_2(value, capsys):
    line = user_error(train_single_gpu.main, ["--time-budget", value], capsys)
    assert "--time-budget takes a positive duration" in line


def test_the_count_is_what_fits_after_epoch_1():
    plain = args_for("--time-budget", "1h", "--epochs", "100")
    one_size = lambda n: run_sizes(plain, n)  # noqa: E731
    # 10 epochs of 10s fit in 95% of 110s (the headroom), 11 would not; 100s holds only 9.
    assert epochs_that_fit(110, EpochTime(8, 2), 100, one_size) == 10
    assert epochs_that_fit(100, EpochTime(8, 2), 100, one_size) == 9
    assert epochs_that_fit(110, EpochTime(8, 2), 6, one_size) == 6  # --epochs is the smaller limit
    assert epochs_that_fit(5, EpochTime(8, 2), 100, one_size) == 1  # too small: the epoch it timed
    # Progressive resizing: epoch 1 trained at 16 px, later epochs at up to 32 px cost up to 4x.
    ramp = args_for("--time-budget", "1h", "--epochs", "20", "--img-size", "32", "--min-img-size", "16",
                    "--ramp-epochs", "10")
    fit = epochs_that_fit(100, EpochTime(8, 2), 20, lambda n: run_sizes(ramp, n))
    assert 3 <= fit < 10
    sizes = run_sizes(ramp, fit)
    assert sizes(1) == 16 and sizes(sizes.ramp_epochs) == 32 and sizes.ramp_epochs == max(2, round(10 * fit / 20))


@pytest.mark.slow
def test_without_epochs_the_budget_alone_decides():
    assert most_epochs(args_for()) == 30
    assert most_epochs(args_for("--time-budget", "1h")) == 1000
    assert most_epochs(args_for("--time-budget", "1h", "--epochs", "7")) == 7
    one_size = lambda n: run_sizes(args_for("--time-budget", "1h"), n)  # noqa: E731
    assert epochs_that_fit(3600, EpochTime(8, 2), 1000, one_size) == 342  # in 95% of the hour
    assert epochs_that_fit(1e9, EpochTime(0.0, 0.0), 1000, one_size) == 1000  # a clock that did not move
    first = EpochTime(8, 2)
    alone = budget_message(args_for("--time-budget", "1h"), 360, first)
    assert alone.endswith("--time-budget 1h fits 360 epochs: training 360")
    capped = budget_message(args_for("--time-budget", "1h", "--epochs", "7"), 7, first)
    assert capped.endswith("--epochs 7 is the smaller limit: training 7 epochs")
    # The ramp of progressive resizing is read against the default 30 epochs when --epochs is not given.
    ramp = args_for("--time-budget", "1h", "--img-size", "32", "--min-img-size", "16", "--ramp-epochs", "15")
    assert run_sizes(ramp, 60).ramp_epochs == 30


def build_schedule(args, steps_per_epoch: int, epochs: int | None = None) -> Callable[[int], float]:
    """The learning rate of each step of a one-process run of `epochs` (the count a budget
    fixed; else --epochs), peaking at 0.1 (--lr 0.1 for a batch of 256)."""
    args.lr, args.batch_size = 0.1, 256
    ctx = DistContext.single()
    return lambda step: learning_rate(step, steps_per_epoch, epochs or args.epochs, args, ctx)


def test_epoch_1_does_not_depend_on_the_count():
    args = args_for("--time-budget", "1h", "--epochs", "30")
    steps = 12
    schedules = [build_schedule(args, steps, epochs) for epochs in (1, 2, 30)]
    for step in range(steps):
        assert len({schedule(step) for schedule in schedules}) == 1
    assert schedules[1](2 * steps - 1) < schedules[2](2 * steps - 1)  # the decay follows the count
    # A warm-up shorter than epoch 1 holds the peak to its end: the decay starts with the count.
    short = args_for("--time-budget", "1h", "--warmup-epochs", "0.5", "--lr-decay", "linear", "--lrf", "0")
    schedules = [build_schedule(short, steps, epochs) for epochs in (1, 2, 30)]
    for step in range(steps):
        assert len({schedule(step) for schedule in schedules}) == 1
    assert [schedules[2](s) for s in (6, 7, 11, 12)] == [pytest.approx(0.1)] * 4
    assert schedules[1](steps + 6) == pytest.approx(0.05) and schedules[1](2 * steps) == 0
    # Without a budget the same warm-up is half an epoch, and the decay starts right after it.
    assert build_schedule(args_for("--epochs", "2", "--warmup-epochs", "0.5"), steps)(11) < 0.1


class FakeClock:
    """How long each epoch's training, and then its evaluation, reports it took: `tick` seconds
    each, `later_tick` from epoch `first_epochs + 1` on (the epochs of this process: a resumed
    run's count from 1)."""

    def __init__(self, tick: float, first_epochs: int = 0, later_tick: float = 0.0):
        self.tick, self.first_epochs, self.later_tick, self.epochs = tick, first_epochs, later_tick, 0

    def train_seconds(self) -> float:
        self.epochs += 1
        return self.tick if self.epochs <= self.first_epochs or not self.later_tick else self.later_tick

    def eval_seconds(self) -> float:
        return self.tick if self.epochs <= self.first_epochs or not self.later_tick else self.later_tick


def train_in_process(data, out, clock: FakeClock, monkeypatch, *extra: str, epochs: int | None = 10) -> None:
    """train_single_gpu.py's run, its epochs' training and evaluation really run, their seconds
    those of `clock` (Trained.seconds and Evaluation.seconds, which the budget counts)."""
    trains, evaluates = train_single_gpu.train_one_epoch, train_single_gpu.evaluate
    monkeypatch.setattr(train_single_gpu, "train_one_epoch",
                        lambda *a, **k: dataclasses.replace(trains(*a, **k), seconds=clock.train_seconds()))
    monkeypatch.setattr(train_single_gpu, "evaluate",
                        lambda *a, **k: dataclasses.replace(evaluates(*a, **k), seconds=clock.eval_seconds()))
    call_main(train_single_gpu.main, ["--data-path", str(data), "--output-dir", str(out), *FAST, *SMALL_MODEL,
                                      "--amp", "off", *(["--epochs", str(epochs)] if epochs else []), *extra])


@pytest.fixture
def tiny(tmp_path):
    """Three photos a class: an epoch of one training batch of 8 and 5 validation images."""
    return copy_sample(tmp_path / "data", per_class=3)


@pytest.mark.slow
def test_a_budget_too_small_gives_one_epoch(tiny, tmp_path, monkeypatch, capsys):
    train_in_process(tiny, tmp_path / "run", FakeClock(10), monkeypatch, "--time-budget", "15")
    out = capsys.readouterr().out
    assert "--time-budget 15 has room for that epoch only: training 1 epoch" in out
    assert [m["epoch"] for m in metrics(tmp_path / "run")] == [1]
    assert json.loads((tmp_path / "run" / "config.json").read_text())["budget_epochs"] == 1


@pytest.mark.slow
def test_slow_epochs_end_early_and_a_resumed_run_keeps_the_count(tiny, tmp_path, monkeypatch, capsys):
    """Run A's epochs take as long as epoch 1 promised: 110s fit 5 epochs of 20s (in 95% of
    it). Run B's epochs after the first take twice as long: the guard ends it after epoch 3
    (100s used, and the next epoch's 20s of training would not fit). Resumed with the same
    budget it has none left; with 140s, it keeps the count of 5 and ends as A did."""
    train_in_process(tiny, tmp_path / "a", FakeClock(10), monkeypatch, "--time-budget", "110")
    assert "--time-budget 110 fits 5 epochs, fewer than --epochs 10: training 5" in capsys.readouterr().out

    train_in_process(tiny, tmp_path / "b", FakeClock(10, first_epochs=1, later_tick=20), monkeypatch,
                     "--time-budget", "110")
    out = capsys.readouterr().out
    assert "ending after epoch 3 of 5" in out
    assert len(metrics(tmp_path / "b")) == 3
    assert torch.load(tmp_path / "b" / "last.pth", weights_only=True)["budget_epochs"] == 5

    # Resumed, the run has what is left of its budget: nothing, until the user gives it more.
    train_in_process(tiny, tmp_path / "b", FakeClock(10), monkeypatch, "--time-budget", "110", "--resume", "auto")
    assert "ending after epoch 3 of 5 (before the resume; a larger --time-budget" in capsys.readouterr().out
    assert len(metrics(tmp_path / "b")) == 3
    train_in_process(tiny, tmp_path / "b", FakeClock(10), monkeypatch, "--time-budget", "140", "--resume", "auto")
    out = capsys.readouterr().out
    assert "epoch 1 took" not in out  # the count is not measured again
    assert [m["epoch"] for m in metrics(tmp_path / "b")] == [1, 2, 3, 4, 5]
    assert json.loads((tmp_path / "b" / "config.json").read_text())["budget_epochs"] == 5
    for a, b in zip(metrics(tmp_path / "a"), metrics(tmp_path / "b")):
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-6)
        assert a["val_loss"] == pytest.approx(b["val_loss"], rel=1e-6)


@pytest.mark.slow
def test_a_budget_alone_is_not_capped_by_the_default_epochs(tiny, tmp_path, monkeypatch, capsys):
    """Epochs of 2s (fake) in 74s: 35 of them (in 95% of it), more than the 30 a run without a
    budget trains."""
    train_in_process(tiny, tmp_path / "run", FakeClock(1), monkeypatch, "--time-budget", "74", epochs=None)
    out = capsys.readouterr().out
    assert "training: epoch 1 of 1000, " in out  # at most 1000, the count fixed after epoch 1
    assert "--time-budget 74 fits 35 epochs: training 35" in out
    assert len(metrics(tmp_path / "run")) == 35
