"""The end of a preempted run: every rank stopped after the same step (train_one_epoch's
"stopped_after"), rank 0 saves that position in last.pth, and the run exits 75 for the
scheduler to requeue it; `--resume auto` then goes on from that step. sigterm.py says when a
SIGTERM is a request and when an exit."""
from __future__ import annotations

import dataclasses
import signal
from pathlib import Path
from typing import Any, NoReturn

from multi_train_utils.distributed_utils import DistContext, barrier
from multi_train_utils.progress import Progress
from outputs.run_folder import LAST, RunFiles
from utils import Preempted


def save_position_and_exit(files: RunFiles | None, epoch: int, progress: Progress, train_stats: dict[str, Any],
                           output_dir: Path, ctx: DistContext) -> NoReturn:
    """Rank 0 saves the position (after any write in flight), and a barrier keeps every process
    from exiting, and so from ending the job, before last.pth is on disk."""
    # The run ends now, its cause known: a later SIGTERM (srun --kill-on-bad-exit sends one to
    # the tasks still running once the first has exited) must not turn this 75 into a 143.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    steps = train_stats["stopped_after"]
    if files:
        files.save_position(dataclasses.replace(progress, epoch=epoch - 1, steps_in_epoch=steps,
                                                epoch_sums=tuple(train_stats["sums"]),
                                                epoch_seconds=progress.epoch_seconds + train_stats["seconds"]))
    barrier(ctx)
    raise Preempted(f"SIGTERM: every process stopped after step {steps} of epoch {epoch}; "
                    f"{output_dir / LAST} holds the position: resume with --resume auto")
