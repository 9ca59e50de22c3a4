"""The run's pictures, drawn by child processes beside the run rather than after it.

Drawing five PNGs takes seconds of matplotlib (its import, then rendering), none of which the
training needs. The plotter's two processes are forked at the run's start and import matplotlib
while the run starts up; one draws the pictures of the data (class balance, augmented samples)
as soon as the run folder records its split, and the curves at the end, the other the report's
pictures once report.json exists. They run at the lowest CPU priority, so they take only what
training leaves idle; the run waits for them at its end (`time:` says how long), and a run
that fails or is stopped ends them. A drawing process that dies (an out-of-memory kill) costs
its pictures, not the run: the run says which were lost, and how to draw them later.
"""
from __future__ import annotations

import multiprocessing
import os
import signal
import time
from pathlib import Path
from collections.abc import Callable
from typing import Any

import torch

from multi_train_utils.distributed_utils import keep_inherited_objects
from plots import figure_class, save_curves, save_data_plots, save_report_plots
from processes.helper_signals import die_with_parent, leave_sigterm_to
from utils import stderr_line

# The plotter's two processes and what each draws on each order, from the files in the run
# folder: at the run's end they draw on two cores at once.
DRAWINGS = (
    {"data": (save_data_plots,), "results": (save_curves,)},
    {"results": (save_report_plots,), "report": (save_report_plots,)},  # "report": --eval-only
)
# What each of them draws, as a lost process's warning says it.
DRAWN = ("the class balance, the augmented samples and the training curves",
         "the report's pictures (confusion matrix, most confident mistakes)")


class Plotter:
    """Rank 0's plotting processes for the run folder `run_dir`, used as a context manager:
    entering it starts them, leaving it waits for their pictures (or ends them after a failure)."""

    def __init__(self, run_dir: Path, context: multiprocessing.context.BaseContext | None = None):
        self.run_dir = run_dir
        self.context = context or multiprocessing.get_context("fork")
        self._children = []
        self._lost: set[int] = set()  # the children that died, by index
        self.waited = 0.0

    def __enter__(self) -> Plotter:
        """Start the processes. Forked, not spawned: a child has the parent's imports already (a
        spawned one would import torch again, seconds of a core); in a process group, from a fork
        server (distributed_utils.prepare_helper_start). Entered before the run starts any thread
        of its own."""
        context = self.context
        for drawings in DRAWINGS:
            receive, send = context.Pipe(duplex=False)
            process = context.Process(target=draw_on_order, args=(receive, self.run_dir, drawings, os.getpid()),
                                      name="plotter", daemon=True)
            process.start()
            receive.close()
            self._children.append((process, send))
        return self

    def draw_data(self) -> None:
        self._order("data")

    def draw_results(self) -> None:
        self._order("results")

    def draw_report(self) -> None:
        self._order("report")

    def _order(self, order: str | None) -> None:
        for i, (_, orders) in enumerate(self._children):
            if i in self._lost:
                continue
            try:
                orders.send(order)
            except OSError:  # BrokenPipeError: the process died
                self._lost.add(i)

    def waited_line(self) -> str:
        return f"waited {self.waited:.1f}s for the plots"

    def __exit__(self, kind: type[BaseException] | None, *_: Any) -> None:
        """At the run's end, wait for the pictures; after a failure or a stop, end the plotter."""
        began = time.perf_counter()
        if kind is None:
            self._order(None)  # no more orders: each process finishes what it has and exits
        for i, (process, orders) in enumerate(self._children):
            if kind is not None:
                process.kill()
            process.join()
            orders.close()
            if kind is None and process.exitcode != 0:
                self._lost.add(i)
        self.waited = time.perf_counter() - began
        if kind is None:
            self._say_lost()

    def _say_lost(self) -> None:
        """Name the pictures a dead drawing process did not draw; the run itself succeeded."""
        for i in sorted(self._lost):
            process = self._children[i][0]
            how = (f"was killed by signal {-process.exitcode}" if process.exitcode and process.exitcode < 0
                   else f"ended with exit code {process.exitcode}")
            stderr_line(f"warning: a plotting process {how} (an out-of-memory kill?), so {DRAWN[i]} may be "
                        f"missing; the training and its files are complete. `python plots.py {self.run_dir}` draws "
                        "every picture again")


def draw_on_order(orders: Any, run_dir: Path, drawings: dict[str, tuple[Callable[[Path], Any], ...]],
                  trainer: int) -> None:
    """A plotter process of the training process `trainer`: draw what each order asks of it,
    until the run says it is done."""
    die_with_parent()
    keep_inherited_objects()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the run's to handle; the run then ends this process
    leave_sigterm_to(trainer)  # so is a SIGTERM to the whole job
    run_only_when_idle()
    torch.set_num_threads(1)  # as a loader worker does: the parent's thread pool did not survive the fork
    figure_class()  # import matplotlib now, while the run starts up
    # The loader workers forked after this process hold the pipe's sending end too: the run says
    # when it is done (None) rather than closing it.
    try:
        for order in iter(orders.recv, None):
            for save in drawings.get(order, ()):
                save(run_dir)
    except EOFError:  # the run was killed: its own end is what the user reads about
        pass


def run_only_when_idle() -> None:
    """The lowest CPU priority there is: Linux's SCHED_IDLE runs this process only on a core
    that nothing else wants (nice 19 would still take a share of a busy one); nice 19 elsewhere."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        os.nice(19)
