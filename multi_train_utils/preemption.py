"""Preemption: SIGTERM, which SLURM, Kubernetes and most schedulers send some time before they
kill a job, stops every rank at the same training step; rank 0 saves that position in last.pth,
and the run exits with 75 (EX_TEMPFAIL) for the scheduler to requeue it: `--resume auto` then
goes on from that step."""
from __future__ import annotations

import argparse
import dataclasses
import signal
from pathlib import Path
from typing import NoReturn

from multi_train_utils.checkpoint import Progress
from multi_train_utils.distributed_utils import DistContext, barrier
from multi_train_utils.run_folder import LAST, EpochWriter, checkpoint_of
from multi_train_utils.train_eval_utils import StoppedInEpoch, Training
from utils import DataSplit, Preempted


class TerminationRequest:
    """SIGTERM turned into a flag: the training loop reads it at its next check
    (train_eval_utils.CHECK_EVERY), and the ranks then stop together. In effect inside the
    `with` block (the main thread's)."""

    def __init__(self) -> None:
        self.received = False

    def __enter__(self) -> TerminationRequest:
        self._previous = signal.signal(signal.SIGTERM, self._note)
        return self

    def __exit__(self, *exc: object) -> None:
        signal.signal(signal.SIGTERM, self._previous)

    def _note(self, signum: int, frame: object) -> None:
        self.received = True

    def __call__(self) -> bool:
        return self.received


def save_position_and_exit(stop: StoppedInEpoch, training: Training, progress: Progress, epoch: int,
                           args: argparse.Namespace, split: DataSplit, output_dir: Path, files: EpochWriter | None,
                           ctx: DistContext) -> NoReturn:
    """Rank 0 saves where every rank stopped inside `epoch` (after any write in flight); no
    process exits before last.pth is on disk, and none ends the job before that either."""
    if files:
        stopped = dataclasses.replace(progress, epoch=epoch - 1, steps_in_epoch=stop.steps_done,
                                      epoch_sums=tuple(stop.sums))
        files.save_position(checkpoint_of(training, stopped, args, split, ctx))
    barrier(ctx)
    raise Preempted(f"SIGTERM: every process stopped after step {stop.steps_done} of epoch {epoch}; "
                    f"{output_dir / LAST} holds the position: resume with --resume auto")
