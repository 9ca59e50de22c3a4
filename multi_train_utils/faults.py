"""Faults during the epochs, each turned into one paragraph on the rank that meets it instead
of a traceback: the connection to another process broken in a collective (that process ended),
a data-loader worker that died, rank 0's checkpoint write that failed. Each names the cause,
what was lost, and the checkpoint a run goes on from with --resume. SHOW_TRACEBACK=1 prints
the traceback before it, for a bug report."""
from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import time
import traceback
from collections.abc import Iterator
from pathlib import Path


from multi_train_utils.checkpoint import load_checkpoint
from multi_train_utils.distributed_utils import DistContext, lost_connection
from multi_train_utils.run_folder import LAST, CheckpointWriteFailed
from utils import ProjectError, UserError, stderr_line


class RunBroken(ProjectError):
    """The run cannot go on: a part of it ended (a peer, a loader worker, a write). Exit code 1."""


@contextlib.contextmanager
def named_faults(output_dir: Path, ctx: DistContext) -> Iterator[None]:
    """The epochs, their faults named (RunBroken)."""
    try:
        yield
    except CheckpointWriteFailed as e:
        show_traceback(e)
        raise RunBroken(f"{e}: the run stops. {what_holds(output_dir, ctx)}") from None
    except RuntimeError as e:  # dist.DistError and its kinds are RuntimeErrors too
        who = f"rank {ctx.rank} on {socket.gethostname()}: " if ctx.distributed else ""
        first_line = (str(e).strip().splitlines() or [type(e).__name__])[0]
        if first_line.startswith("DataLoader worker"):
            # torch's SIGCHLD handler raises again at each later child's exit while the dead
            # worker's loader lives (another loader's worker, killed with it), which would break
            # the reading of last.pth below: the run is ending, its children no longer matter.
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            cause = (f"{who}a data-loader worker died ({first_line}); the kernel kills one that runs out of memory "
                     "(`dmesg` says so): lower --workers or --batch-size, or give the job more memory")
        elif ctx.distributed and lost_connection(e):
            cause = (f"{who}the connection to another process of the job broke during a collective "
                     f"({short(first_line)}): {silent_ranks(ctx)}")
        else:
            raise
        show_traceback(e)
        raise RunBroken(f"{cause}. {what_holds(output_dir, ctx)}") from None


# Seconds the ranks that meet a broken collective take to say they are still there.
ROLL_CALL_SECONDS = 5.0


def silent_ranks(ctx: DistContext, wait_s: float = ROLL_CALL_SECONDS) -> str:
    """Which process ended, found by a roll call in the rendezvous store: every rank that meets
    the broken collective says it is there, and those that do not within `wait_s` are named
    (the one that ended is among them; one that hangs would be too)."""
    try:
        ctx.store.set(f"present/{ctx.rank}", "1")
        until = time.monotonic() + wait_s
        while (silent := [r for r in range(ctx.world_size) if not ctx.store.check([f"present/{r}"])]) and \
                time.monotonic() < until:
            time.sleep(0.1)
    except (RuntimeError, AttributeError):  # DistNetworkError: the store went with its host
        return ("the rendezvous store is gone too, so the process that hosts it ended (rank 0, or torchrun's agent), "
                "and its own output says why")
    if not silent:
        return "every rank is still there: a network fault between them? NCCL_DEBUG=INFO or gloo's message says more"
    named = ", ".join(f"rank {r}" for r in silent[:8]) + (f" and {len(silent) - 8} more" if len(silent) > 8 else "")
    return (f"{named} did not answer in {wait_s:g}s, so it ended (or hangs), and its own output says why; "
            "this one stops too")


def short(line: str) -> str:
    """gloo's message without its source location and its advice: "Read error [HOST]:PORT: Connection reset by peer"."""
    line = re.sub(r"^\[[^\]]*\.(cc|cpp|hpp):\d+\]\s*", "", line)
    return line.split(". ")[0]


def what_holds(output_dir: Path, ctx: DistContext) -> str:
    """The checkpoint a stopped run goes on from: rank 0's last.pth, whose epoch rank 0 reads
    (the others may not see its disk)."""
    last = output_dir / LAST
    if not ctx.is_main:
        return f"Rank 0's {last} holds the last epoch it saved: go on from it with --resume auto"
    if not last.is_file():
        return "No checkpoint was saved yet: the run starts from the beginning when run again"
    try:
        checkpoint = load_checkpoint(last, mmap=True)
        epoch, steps = checkpoint["epoch"], checkpoint.get("steps_in_epoch", 0)
    except UserError as e:
        return f"{e}: the run starts from the beginning when run again"
    inside = f" and {steps} steps of epoch {epoch + 1}" if steps else ""
    return f"{last} holds epoch {epoch}{inside}: go on from it with --resume auto (and the same --output-dir)"


def show_traceback(error: BaseException) -> None:
    """The traceback of `error`, when SHOW_TRACEBACK=1 asks for it."""
    if os.environ.get("SHOW_TRACEBACK") == "1":
        stderr_line("".join(traceback.format_exception(error)).rstrip())
