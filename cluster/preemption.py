"""The end of a preempted run: a SIGTERM came (SLURM's warning, a preemption, scancel, torchrun
passing one on), every rank stopped after the same step (train_one_epoch's or evaluate's look),
rank 0 saves that position in last.pth and says so in preempted.txt beside it, and every process
exits 75 (EX_TEMPFAIL: "try again later"). `--resume auto` goes on from that step. A job script
requeues the job when the scheduler's signal came and preempted.txt is there (flowers.sbatch)."""
from __future__ import annotations

import dataclasses
import signal
from pathlib import Path
from typing import Any, NoReturn

from multi_train_utils.checkpoint import LAST, make_checkpoint, save_checkpoint
from multi_train_utils.distributed_utils import DistContext, barrier
from utils import Preempted, write_text_atomic


def save_position_and_exit(model: Any, optimizer: Any, scaler: Any, extra: Any, progress: Any, trained: Any,
                           epoch: int, split: Any, output_dir: Path, args: Any, ctx: DistContext) -> NoReturn:
    """Rank 0 saves the position (the batches every rank trained in `epoch`: all of them when the
    evaluation was stopped, which the resumed run then redoes), and a barrier keeps every process
    from exiting, and so from ending the job, before last.pth is on disk. Collective: the barrier."""
    # The run ends now, its cause known: a later SIGTERM (srun --kill-on-bad-exit sends one to the tasks
    # still running once the first has exited) must not turn this 75 into a 143.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    position = dataclasses.replace(progress, epoch=epoch - 1, steps_in_epoch=trained.batches, epoch_sums=trained.sums,
                                   epoch_seconds=progress.epoch_seconds + trained.seconds)
    line = (f"SIGTERM: every process stopped after step {trained.batches} of epoch {epoch}; "
            f"{output_dir / LAST} holds the position: resume with --resume auto")
    if ctx.is_main:
        save_checkpoint(make_checkpoint(model, optimizer, scaler, position, args, split.class_names, ctx.world_size,
                                        extra), output_dir)
        write_text_atomic(output_dir / "preempted.txt", line + "\n")  # what flowers.sbatch requeues on
    barrier(ctx)  # barrier: no process exits before last.pth is on disk
    raise Preempted(line)
