"""SIGTERM in the helper processes of a training process (loader workers, plotters, the fork
server). SLURM's slurmstepd, torchrun's agent, `docker stop` with an init and `kill -TERM -PGID`
signal every process of a job; the training process alone acts on it (it stops at a step and
saves its position), and needs its helpers until then: a loader worker that died of the signal
would fail the run instead. So a helper ignores SIGTERM, and ends when its training process
does (die_with_parent; torch's own watchdog in a loader worker too, within seconds)."""
from __future__ import annotations

import contextlib
import ctypes
import multiprocessing.context
import signal
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def sigterm_blocked() -> Iterator[None]:
    """SIGTERM blocked in this thread meanwhile, and from the start in a process it forks."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


@contextlib.contextmanager
def sigterm_ignored_in_new_programs() -> Iterator[None]:
    """Meanwhile, a program that this process starts (a fork and an exec: the fork server)
    ignores SIGTERM from its first instruction: an ignored signal stays ignored across exec,
    where a blocked mask does not (subprocess's fork_exec clears it). This process keeps its
    own: a SIGTERM that comes meanwhile waits, blocked (Linux keeps a blocked signal pending even
    while it is ignored), and reaches the handler after. From the main thread only."""
    with sigterm_blocked():
        handler = signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if handler is None else handler)


class ForkedWithSigtermBlocked(multiprocessing.context.ForkProcess):
    """A forked helper that starts with SIGTERM blocked, so that none kills it before it
    ignores the signal (ignore_sigterm, its first call)."""

    def start(self) -> None:
        with sigterm_blocked():
            super().start()


class ForkWithSigtermBlocked(multiprocessing.context.ForkContext):
    Process = ForkedWithSigtermBlocked


def ignore_sigterm() -> None:
    """Every SIGTERM left alone: ignored, and then unblocked (a forked helper starts with it
    blocked: ForkWithSigtermBlocked)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


def die_with_parent() -> None:
    """End this child process the moment the process that started it ends, however that one
    ended: otherwise a child orphaned by SIGKILL lingers, holding the job's terminal or log pipe
    open after the launcher has gone."""
    if sys.platform == "linux":
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
