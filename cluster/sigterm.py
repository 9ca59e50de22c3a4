"""SIGTERM, which SLURM (its time limit's warning, scancel), Kubernetes, torchrun's agent and the
spawn launcher send some time before a job is killed. Before training a process exits at once
with 75 (EX_TEMPFAIL: "requeue me"): nothing of the run is lost, it goes on from its last
checkpoint with --resume auto. Once training runs, the signal is a request: train_one_epoch
looks at it with every rank, all stop after the same step, rank 0 saves that position
(preemption.save_position_and_exit), and every process exits 75.

Only the standard library here: each launcher sets the handler before it imports torch."""
from __future__ import annotations

import os
import signal
import sys


class Preemption:
    """The state of one process's SIGTERM: whether one came, and whether training runs (a
    request then, else an exit)."""

    def __init__(self) -> None:
        self.came = False
        self.training = False

    def on_sigterm(self, signum: int, frame: object) -> None:
        self.came = True
        if self.training:
            return
        # Once is enough: this process is ending (srun --kill-on-bad-exit and torchrun send more).
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            sys.stdout.flush()
            sys.stderr.write("stopped: SIGTERM before training: this process ends here with 75; with --resume auto "
                             "the run goes on from its last checkpoint, if it has one\n")
            sys.stderr.flush()
        except (OSError, RuntimeError, ValueError):  # a write the signal interrupted, or a closed stream
            pass
        # os._exit, not an exception: raised wherever the signal lands, SystemExit could cut short an
        # import (torch's or numpy's, which then fails the process with exit 1: "cannot load module more
        # than once per process") or importlib's own module locks (a process that never ends). Before
        # training nothing is lost: the peers, the scheduler and torchrun see the 75.
        os._exit(75)

    def requested(self) -> bool:
        return self.came
