"""SIGTERM in the helper processes of a training process (loader workers, plotters, the fork
server). SLURM's slurmstepd, torchrun's agent, `docker stop` with an init and `kill -TERM -PGID`
signal every process of a job; the training process alone acts on it (it stops at a step and
saves its position), and needs its helpers until then: a loader worker that died of the signal
would fail the run instead. So a helper leaves a SIGTERM from anyone else to it, and ends on one
from it (as torch's own handler in a loader worker ends on its parent's: multiprocessing ends
its children so as the process exits, and waits for them) or when it ends (die_with_parent)."""
from __future__ import annotations

import contextlib
import ctypes
import multiprocessing.context
import os
import signal
import sys
import threading
from collections.abc import Iterator


@contextlib.contextmanager
def sigterm_blocked() -> Iterator[None]:
    """SIGTERM blocked in this thread meanwhile, and from the start in a process it starts (a
    fork, and an exec, keep the mask)."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


class ForkedWithSigtermBlocked(multiprocessing.context.ForkProcess):
    """A forked helper whose threads, all made after the fork, start with SIGTERM blocked: the
    signal then reaches only the thread of leave_sigterm_to's, never a handler of torch's in a
    thread the helper made before that ran (the fork server's children inherit its mask)."""

    def start(self) -> None:
        with sigterm_blocked():
            super().start()


class ForkWithSigtermBlocked(multiprocessing.context.ForkContext):
    Process = ForkedWithSigtermBlocked


def ignore_sigterm() -> None:
    """Every SIGTERM left alone, blocked and ignored: the fork server's way (it ends with the
    training process in any case, and its children inherit the blocked signal)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a thread that does not block it drops it


def leave_sigterm_to(trainer: int) -> None:
    """In a helper of the training process `trainer`: a SIGTERM from that process ends this one;
    one from anyone else is left to it. The signal stays blocked (from the fork on), and a
    thread of this process's own takes it with sigwaitinfo, which tells who sent it (a Python
    handler is not told)."""
    ignore_sigterm()
    if not hasattr(signal, "sigwaitinfo"):  # Linux and most Unixes, not macOS
        return

    def wait_for_the_trainers_sigterm() -> None:
        while signal.sigwaitinfo({signal.SIGTERM}).si_pid != trainer:
            pass
        os._exit(0)

    threading.Thread(target=wait_for_the_trainers_sigterm, name="sigterm", daemon=True).start()


def die_with_parent() -> None:
    """End this child process the moment the process that started it ends, however that one
    ended: otherwise a child orphaned by SIGKILL lingers, holding the job's terminal or log pipe
    open after the launcher has gone."""
    if sys.platform == "linux":
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
