"""Preemption: SIGTERM, which SLURM, Kubernetes and most schedulers send some time before they
kill a job, stops every rank at the same training step; rank 0 saves that position in last.pth,
and the run exits with 75 (EX_TEMPFAIL) for the scheduler to requeue it: `--resume auto` then
goes on from that step."""
from __future__ import annotations

import dataclasses
import signal
from pathlib import Path
from typing import Any, NoReturn

from multi_train_utils.distributed_utils import DistContext, barrier
from multi_train_utils.progress import Progress
from outputs.run_folder import LAST, RunFiles
from utils import Preempted


def exit_75_on_sigterm() -> None:
    """Outside training (from here until TerminationRequest takes over, and after a finished
    run), a SIGTERM ends the process with 75, as a stop during training does: a scheduler that
    preempts the job during its start-up then requeues it too, instead of seeing 143 (killed by
    SIGTERM). Nothing of the run is lost: it goes on from its last checkpoint, if any, with
    --resume auto."""
    signal.signal(signal.SIGTERM, _raise_preempted)


def _raise_preempted(signum: int, frame: object) -> NoReturn:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once is enough: the process is ending
    raise Preempted("SIGTERM while the run was starting or ending, not training: this process ends here; with "
                    "--resume auto the run goes on from its last checkpoint, if it has one")


class TerminationRequest:
    """SIGTERM turned into a flag: the training loop reads it at its next check
    (train_eval_utils.CHECK_EVERY), and the ranks then stop together (save_position_and_exit).
    In effect inside the `with` block (the main thread's), which
    faults.handling_sigterm_and_faults enters for the run in `output_dir`."""

    def __init__(self, output_dir: Path, ctx: DistContext) -> None:
        self.output_dir, self.ctx = output_dir, ctx
        self.received = False

    def __enter__(self) -> TerminationRequest:
        self._previous = signal.signal(signal.SIGTERM, self._note)
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        if kind is not None:
            # Ending, its cause known (a stop with the position saved, or a fault it is naming):
            # a later SIGTERM changes nothing. `srun --kill-on-bad-exit` sends one to every task
            # still running once the first has exited non-zero: a stopped task that died of it
            # would make srun report 143, not 75, and a failing one would lose its cause.
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        else:
            signal.signal(signal.SIGTERM, self._previous)

    def _note(self, signum: int, frame: object) -> None:
        self.received = True

    def __call__(self) -> bool:
        return self.received

    def save_position_and_exit(self, files: RunFiles | None, epoch: int, progress: Progress,
                               train_stats: dict[str, Any]) -> NoReturn:
        """Every rank stopped after the same step of `epoch` (train_one_epoch's "stopped_after"):
        rank 0 saves that position (after any write in flight), and a barrier keeps every process
        from exiting, and so from ending the job, before last.pth is on disk."""
        steps = train_stats["stopped_after"]
        if files:
            files.save_position(dataclasses.replace(progress, epoch=epoch - 1, steps_in_epoch=steps,
                                                    epoch_sums=tuple(train_stats["sums"])))
        barrier(self.ctx)
        raise Preempted(f"SIGTERM: every process stopped after step {steps} of epoch {epoch}; "
                        f"{self.output_dir / LAST} holds the position: resume with --resume auto")
