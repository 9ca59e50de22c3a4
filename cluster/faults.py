"""SIGTERM and the faults of a run, each turned into one paragraph on every rank instead of a
traceback: the connection to another process broken in a collective (that process ended), a
data-loader worker that died, rank 0's checkpoint write that failed. Each names the cause, what
was lost, and the checkpoint a run goes on from with --resume. SHOW_TRACEBACK=1 prints the
traceback before it, for a bug report.

Which process ended is known for sure, not guessed from who answers: each rank says in the
job's store who it is (machine and process id) and, from a thread of its own, that it is still
there (a count it raises every second). A rank that meets a broken collective looks: a process
that shares its view of process ids (the same boot of the same machine, the same PID
namespace) has ended when its process id is gone or owned by a process that started at
another time, and its count has stopped; any other, when its count has stopped for
SILENT_SECONDS. Containers that share a host name (`docker run
--network host`, Kubernetes' hostNetwork) each have a PID namespace of their own: there a
process id means nothing to the other. The first rank to know writes the answer in the store,
and every other rank, still waiting inside a collective that will never finish, reads it there within a second (or
sees for itself a process of its own machine gone: on NCCL, where a lost peer raises nothing
this process could catch, that is the only sign) and ends with the same paragraph.
"""
from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path

from cluster.preemption import TerminationRequest
from multi_train_utils.checkpoint import load_checkpoint
from multi_train_utils.distributed_utils import DistContext, lost_connection
from outputs.run_folder import LAST, CheckpointWriteFailed
from utils import Preempted, ProjectError, TrainingDiverged, UserError, stderr_line

# How often each rank says it is still there, and how long a silence on another machine takes
# to count as an end (a rank whose thread the machine starves still speaks within it).
BEAT_SECONDS = 1.0
SILENT_SECONDS = 5.0
# How long rank 0, where it hosts the store, waits after a fault for the others to read the cause.
LINGER_SECONDS = 3.0
# A count that moved this recently shows its process alive, whatever its process id says
# (an id read in another PID namespace, or one the kernel gave to a new process).
FRESH_SECONDS = 2.5 * BEAT_SECONDS
# How long the watching thread leaves the main thread to end the process itself (a Ctrl-C that
# reached every rank is being handled) before it ends a process that waits in a collective.
GRACE_SECONDS = 2.0


class RunBroken(ProjectError):
    """The run cannot go on: a part of it ended (a peer, a loader worker, a write). Exit code 1."""


@contextlib.contextmanager
def handling_sigterm_and_faults(output_dir: Path, ctx: DistContext) -> Iterator[TerminationRequest]:
    """The rest of the run, with SIGTERM turned into a request (train_one_epoch reads it, the
    ranks then stop together, and save_position_and_exit ends the run) and its faults named
    (RunBroken) on every rank."""
    watch = FaultWatch(output_dir, ctx).start() if ctx.distributed else None
    try:
        with TerminationRequest(output_dir, ctx) as sigterm:
            yield sigterm
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
        elif watch and lost_connection(e):
            cause = (f"{who}the connection to another process of the job broke during a collective "
                     f"({short(first_line)}): {watch.who_ended()}")
        else:
            if watch:
                watch.failed(e)
            raise
        show_traceback(e)
        if watch:
            watch.keep_store_up()
        raise RunBroken(f"{cause}. {what_holds(output_dir, ctx)}") from None
    except (Preempted, TrainingDiverged):  # decided together (a collective): no rank ended before the others
        if watch:
            watch.finished()
        raise
    except ProjectError as e:  # maybe this rank's alone (a download, a file it cannot see): the others learn why
        if watch:
            watch.failed(e)
        raise
    except Exception as e:  # a bug, or a file that stopped decoding: this rank ends first, the others learn why
        if watch:
            watch.failed(e)
        raise
    else:
        if watch:
            watch.finished()
    finally:
        if watch:
            watch.close()


class FaultWatch:
    """This rank's part in naming a process that ended (the module's docstring says how): its
    machine and process id in the store, and a thread that counts in the store every
    BEAT_SECONDS, and ends this process with the job's paragraph once a rank has written which
    process ended, or once it sees a process of its own machine gone (which also holds on NCCL,
    where a lost peer raises nothing that this process could catch)."""

    def __init__(self, output_dir: Path, ctx: DistContext):
        self.output_dir, self.ctx, self.store = output_dir, ctx, ctx.store
        self.ending = threading.Lock()  # held by whichever of this rank's threads ends the process
        self.closed = threading.Event()
        self.here = socket.gethostname()
        self.view = process_id_view()
        self.neighbours: dict[int, tuple[int, str]] = {}  # the ranks sharing this view of process ids: id, start
        self.elsewhere: set[int] = set()  # the ranks of other machines and PID namespaces
        self.beats: dict[int, tuple[int, float]] = {}  # a neighbour's last count, and when it was seen to move

    def start(self) -> FaultWatch:
        """Say who this rank is in the store, and start counting there."""
        self.store.set(f"who/{self.ctx.rank}", f"{self.view} {os.getpid()} {started_at(os.getpid())}")
        self.store.add(f"beat/{self.ctx.rank}", 1)
        threading.Thread(target=self._beat, name="fault watch", daemon=True).start()
        return self

    def _beat(self) -> None:
        while not self.closed.wait(BEAT_SECONDS):
            try:
                self.store.add(f"beat/{self.ctx.rank}", 1)
                found = self.store.get("ended").decode() if self.store.check(["ended"]) else None
                if found is None and (gone := self._neighbours_gone()):
                    found = self._write_ended(gone)
            except Exception:  # noqa: BLE001 -- the store went away: found by the main thread, if it matters
                return
            if found and not self.closed.wait(GRACE_SECONDS) and self.ending.acquire(blocking=False):
                # This rank waits in a collective that cannot finish: end it from here.
                with contextlib.suppress(Exception):
                    self.store.set(f"stopping/{self.ctx.rank}", "1")
                    self.keep_store_up()
                stderr_line(f"error: rank {self.ctx.rank} on {self.here}: {found}; this one stops too. "
                            f"{what_holds(self.output_dir, self.ctx)}")
                sys.stdout.flush()
                os._exit(1)

    def _neighbours_gone(self) -> list[int]:
        """The ranks of this machine whose process is gone without having finished; their ids
        are read from the store until every rank has written its own."""
        missing = [r for r in range(self.ctx.world_size)
                   if r != self.ctx.rank and r not in self.neighbours and r not in self.elsewhere]
        for r in missing:
            if self.store.check([f"who/{r}"]):
                view, pid, start = self.store.get(f"who/{r}").decode().split()
                if view == self.view:
                    self.neighbours[r] = int(pid), start
                else:
                    self.elsewhere.add(r)
        gone = [r for r, (pid, start) in self.neighbours.items() if not self._beating(r) and not alive(pid, start)]
        return [r for r in gone if not self.store.check([f"finished/{r}"]) and not self.store.check([f"stopping/{r}"])]

    def _beating(self, rank: int) -> bool:
        """Whether `rank`'s count moved within FRESH_SECONDS (a rank is never named while it beats)."""
        count, now = self.store.add(f"beat/{rank}", 0), time.monotonic()
        last, moved = self.beats.get(rank, (None, now))
        if count != last:
            self.beats[rank] = (count, now)
            return True
        return now - moved < FRESH_SECONDS

    def _write_ended(self, ended: list[int]) -> str:
        """Write which ranks ended, unless a rank wrote it first; what the store then holds."""
        named = ", ".join(f"rank {r}" for r in ended[:8]) + (f" and {len(ended) - 8} more" if len(ended) > 8 else "")
        self.store.compare_set("ended", "", f"{named} ended (found by rank {self.ctx.rank}), and its own output "
                                            "says why")
        return self.store.get("ended").decode()

    def who_ended(self) -> str:
        """Which process of the job ended, found as the module's docstring says, and written in
        the store for the ranks that wait in a collective."""
        self.ending.acquire()  # this thread ends the process now, not the watching one
        store, ctx = self.store, self.ctx
        try:
            store.set(f"stopping/{ctx.rank}", "1")  # this one stops because of the fault: it did not end first
            if store.check(["ended"]):
                return store.get("ended").decode()
            if ended := self._ended():
                return self._write_ended(ended)
            return ("no process of the job has ended: a network fault between them? NCCL_DEBUG=INFO or gloo's "
                    "message says more")
        except (RuntimeError, AttributeError):  # DistNetworkError: the store went with its host
            return (f"the rendezvous store is gone too, so {ctx.store_host}, which hosts it, ended, and its own output "
                    "says why")

    def _ended(self) -> list[int]:
        """The ranks that ended, other than those that stop because of the fault."""
        store, ctx = self.store, self.ctx
        others = [r for r in range(ctx.world_size) if r != ctx.rank]
        where = {r: store.get(f"who/{r}").decode().split() for r in others if store.check([f"who/{r}"])}
        gone = [r for r in others if r in where and where[r][0] == self.view and not alive(int(where[r][1]), where[r][2])]
        remote = [r for r in others if r in where and where[r][0] != self.view]
        if remote:
            before = {r: store.add(f"beat/{r}", 0) for r in remote}
            until = time.monotonic() + SILENT_SECONDS
            while remote and time.monotonic() < until:
                time.sleep(0.2)
                remote = [r for r in remote if store.add(f"beat/{r}", 0) == before[r]]
            gone += remote
        return sorted(r for r in gone if not store.check([f"stopping/{r}"]) and not store.check([f"finished/{r}"]))

    def keep_store_up(self) -> None:
        """Where this process hosts the store (rank 0 under srun, and under torchrun's restarts):
        before it leaves on a fault, wait until every other rank has read which process ended
        (each says it stops), at most LINGER_SECONDS. Leaving at once, it would take the store
        with it, and a rank that had yet to read the store would name rank 0 instead."""
        if not (self.ctx.is_main and self.ctx.store_host == "rank 0"):
            return
        others = [r for r in range(self.ctx.world_size) if r != self.ctx.rank]
        until = time.monotonic() + LINGER_SECONDS
        with contextlib.suppress(RuntimeError):
            while time.monotonic() < until and not all(
                    self.store.check([f"stopping/{r}"]) or self.store.check([f"finished/{r}"])
                    or (r in self.neighbours and not alive(*self.neighbours[r])) for r in others):
                time.sleep(0.1)

    def failed(self, error: BaseException) -> None:
        """This rank ends on an error of its own: written where the others, whose collective then
        breaks, read which process ended and why (before this one leaves the process group)."""
        first_line = (str(error).strip().splitlines() or [""])[0]
        with contextlib.suppress(RuntimeError):
            self.store.compare_set("ended", "", f"rank {self.ctx.rank} on {self.here} failed with "
                                                f"{type(error).__name__}: {short(first_line)}, and its own output "
                                                "says more")

    def finished(self) -> None:
        """This rank ends with the others (the run's end, a preemption, a NaN loss): its exit is no fault."""
        with contextlib.suppress(RuntimeError):
            self.store.set(f"finished/{self.ctx.rank}", "1")

    def close(self) -> None:
        self.closed.set()


def process_id_view() -> str:
    """What a process id of this process means: the machine's boot (its boot id, unique to one
    boot of one machine, where host names may repeat) and this process's PID namespace."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        namespace = os.readlink("/proc/self/ns/pid").removeprefix("pid:")
    except OSError:  # not Linux: the host name is all there is
        return socket.gethostname()
    return f"{socket.gethostname()}/{boot}/{namespace}".replace(" ", "_")


def started_at(pid: int) -> str:
    """When the process `pid` started, in clock ticks since the machine booted (/proc's
    starttime): with its id, it names one process, where an id alone may be given to a new
    process once its first owner has ended. "-" where /proc cannot say."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return "-"


def alive(pid: int, start: str = "-") -> bool:
    """Whether the process `pid` of this machine runs (a zombie has ended), and is still the
    one that started at `start` (started_at), not a new owner of its id."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return fields[0] != "Z" and start in ("-", fields[19])
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True


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
