"""--trace-collectives: where the ranks meet, recorded. Every collective this process makes
through `torch.distributed` (the project's helpers, and those that DDP, SyncBatchNorm and the
object collectives make inside torch) is written down with its kind, its size and the launcher
line that led to it, read from the Python stack. DDP's gradient all-reduces happen in its C++
reducer, out of Python's sight: a traced run gives DDP torch's own `allreduce_hook` (the same
sums, made through `dist.all_reduce`), so they are recorded too. What DDP's C++ does beyond
them stays unseen (when it rebuilds its buckets after the first step, it broadcasts their
layout from rank 0). A size is the bytes of the tensors handed to the call (an all_gather's
output list included); an object collective's, a barrier's and DDP's check of the parameters'
shapes count none.

At the end of each epoch rank 0 prints its collectives of the epoch grouped by launcher line;
at the end of the run every rank writes its whole list, one collective a line, in the order
made, to `collectives/rank<R>.tsv` in the run folder (every rank its own: that is the point).
By the rule of collectives every rank's list is the same; `tests/test_collective_trace.py`
checks it, and checks the launchers' comments and the tour against the lists.

Torch's own Flight Recorder (TORCH_NCCL_TRACE_BUFFER_SIZE) records the process group's
collectives in C++, on the backends and torch versions that have it, without the Python line
that led to them: it says what hung; this says why each collective is there, on every torch the
project supports. A replayed CUDA graph makes its collectives without Python, so a traced run
steps eagerly (docs/how-it-works.md).
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import os
import sys
import threading
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

@dataclasses.dataclass(frozen=True)
class Collective:
    index: int
    call: str  # torch.distributed's function
    kind: str  # all_reduce, broadcast, all_gather, barrier, ...
    bytes: int  # the tensors' bytes; 0 for an object collective or a barrier
    line: int  # the launcher's line that led to it; 0: none (before or after the launcher's code)
    via: str  # the project's functions from that line down, then torch's that made the call

    def row(self) -> str:
        return f"{self.index}\t{self.kind}\t{self.call}\t{self.bytes}\t{self.line}\t{self.via}"


class Trace:
    """This process's collectives, in the order made."""

    # torch.distributed's functions that make a collective, by the name a reader meets. An object
    # collective (broadcast_object_list, all_gather_object) is recorded as itself, not as the
    # broadcasts and gathers it makes inside.
    TRACED = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter",
              "reduce_scatter_tensor", "reduce_scatter_single", "reduce", "gather", "scatter", "all_to_all",
              "all_to_all_single", "barrier", "monitored_barrier",
              "broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list",
              "_broadcast_coalesced", "_verify_params_across_processes")
    # What a reader calls each: the word a launcher's comment uses for it.
    KINDS = {"all_reduce": "all_reduce", "broadcast": "broadcast", "broadcast_object_list": "broadcast",
             "_broadcast_coalesced": "broadcast", "all_gather": "all_gather", "all_gather_into_tensor": "all_gather",
             "all_gather_single": "all_gather",
             "all_gather_object": "all_gather", "_verify_params_across_processes": "all_gather",
             "gather_object": "gather", "gather": "gather", "barrier": "barrier", "monitored_barrier": "barrier"}
    PROJECT = Path(__file__).resolve().parent.parent
    TORCH = Path(torch.__file__).resolve().parent
    current: Trace | None = None  # one per process, as torch.distributed's functions are

    def __init__(self, launcher: str):
        self.launcher = _real(launcher)
        self.made: list[Collective] = []
        self.printed = 0  # the collectives rank 0 has already printed
        self.lock = threading.Lock()

    def record(self, call: str, args: tuple, kwargs: dict[str, Any]) -> None:
        frames = _stack(sys._getframe(2))
        if not any(_real(f.f_code.co_filename) == self.launcher for f in frames):
            # DDP's hook runs on autograd's thread: the training thread's stack says where it is.
            main = sys._current_frames().get(threading.main_thread().ident)
            frames = _stack(main) + frames if main is not None else frames
        line, via = self.origin(frames)
        with self.lock:
            size = 0 if call == "_verify_params_across_processes" else _bytes(args, kwargs)  # shapes compared
            self.made.append(Collective(len(self.made) + 1, call, self.KINDS.get(call, call), size, line, via))

    def origin(self, frames: list) -> tuple[int, str]:
        """The innermost launcher line of `frames` (outermost first), and the calls below it."""
        at = max((i for i, f in enumerate(frames) if _real(f.f_code.co_filename) == self.launcher), default=None)
        below = [f for f in (frames[at + 1:] if at is not None else frames)
                 if _real(f.f_code.co_filename) != _real(__file__)]
        ours = [i for i, f in enumerate(below) if _inside(f, self.PROJECT) and not _inside(f, self.TORCH)]
        project = [getattr(below[i].f_code, "co_qualname", below[i].f_code.co_name) for i in ours]
        # torch's function that made the call, where torch made it (DDP's, SyncBatchNorm's), not ours
        torch_side = [f.f_code.co_name for f in below[(ours[-1] + 1 if ours else 0):] if _inside(f, self.TORCH)]
        via = " > ".join(project + ([f"torch:{torch_side[-1]}"] if torch_side else []))
        return (frames[at].f_lineno if at is not None else 0), via

    def grouped(self, title: str, output_dir: Path) -> list[str]:
        """The collectives since the last print, grouped by launcher line, in the order made."""
        with self.lock:
            made, self.printed = self.made[self.printed:], len(self.made)
        groups: dict[tuple, list[Collective]] = collections.defaultdict(list)
        for c in made:
            groups[(c.line, c.kind, c.via)].append(c)
        lines = [f"{title}: {len(made)} on rank 0, by launcher line (every rank's list: "
                 f"{output_dir / 'collectives'}/rank<R>.tsv)"]
        for (line, kind, via), found in sorted(groups.items(), key=lambda g: g[1][0].index):
            size = sum(c.bytes for c in found)
            lines.append(f"  line {line:>3}: {len(found):>4} x {kind:<10} {_size(size):>9}  via {via}")
        return lines

    def write(self, output_dir: Path, rank: int) -> None:
        folder = output_dir / "collectives"
        folder.mkdir(exist_ok=True)
        with self.lock:
            rows = [c.row() for c in self.made]
        header = "index\tkind\tcall\tbytes\tline\tvia\n"
        (folder / f"rank{rank}.tsv").write_text(header + "".join(r + "\n" for r in rows))


def start(launcher: str) -> None:
    """Record every collective this process makes from now on (start before joining the process
    group: joining makes one)."""
    if Trace.current is not None:
        return
    Trace.current = Trace(launcher)
    for name in Trace.TRACED:
        if hasattr(dist, name):
            setattr(dist, name, _recorded(name, getattr(dist, name)))


def all_reduce_gradients_in_python(model: torch.nn.Module) -> None:
    """DDP's gradient all-reduces made by torch's own allreduce_hook, through `dist.all_reduce`,
    where the trace sees them, instead of by its C++ reducer: the same sums."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    model.register_comm_hook(None, allreduce_hook)


def print_epoch(epoch: int, output_dir: Path, ctx: Any) -> None:
    """Rank 0 prints the collectives it made since the last print, grouped by launcher line."""
    if Trace.current is not None and ctx.is_main:
        title = f"collectives of epoch {epoch}" if Trace.current.printed else f"collectives of the start and epoch {epoch}"
        print("\n".join(Trace.current.grouped(title, output_dir)), flush=True)


def write(output_dir: Path, ctx: Any) -> None:
    """At the end, however the run ended: each rank writes its list, and rank 0 prints what
    came after its last epoch (the report's collectives)."""
    if Trace.current is None:
        return
    try:
        Trace.current.write(output_dir, ctx.rank)
    except OSError as e:  # a full or lost disk: the run's own error, if any, is the one to report
        print(f"warning: rank {ctx.rank} could not write its list of collectives: {e}", file=sys.stderr)
    if ctx.is_main and Trace.current.printed < len(Trace.current.made):
        print("\n".join(Trace.current.grouped("collectives after the epochs", output_dir)), flush=True)


def _recorded(name: str, function: Any) -> Any:
    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if Trace.current is not None:
            Trace.current.record(name, args, kwargs)
        return function(*args, **kwargs)
    return wrapper


def _stack(frame: Any) -> list:
    """The frames from the outermost to `frame`."""
    frames = []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    return frames[::-1]


def _inside(frame: Any, folder: Path) -> bool:
    return _real(frame.f_code.co_filename).startswith(str(folder) + os.sep)


@functools.lru_cache(maxsize=None)
def _real(filename: str) -> str:
    """The file's path with its links resolved, as PROJECT's and TORCH's are."""
    return os.path.realpath(filename)


def _bytes(args: tuple, kwargs: dict[str, Any]) -> int:
    def size(x: Any) -> int:
        if isinstance(x, torch.Tensor):
            return x.numel() * x.element_size()
        if isinstance(x, (list, tuple)):
            return sum(size(y) for y in x)
        return 0
    return sum(size(a) for a in (*args, *kwargs.values()))


def _size(n: int) -> str:
    return "" if n == 0 else f"{n} B" if n < 10_000 else f"{n / 1e3:.0f} kB" if n < 10_000_000 else f"{n / 1e6:.1f} MB"
