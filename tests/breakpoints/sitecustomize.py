"""Breakpoints for a real run, put on every Python process of a job through PYTHONPATH (Python
imports `sitecustomize` at start-up): BREAKPOINTS lists `path:line` pairs, and each process
writes the ones it reached, as a debugger would have stopped there, to BREAKPOINTS_OUT/PID.json
when it exits. Used by tests/test_distributed.py on the torchrun launcher's nine steps.

SIGTERM_AT=`path:line` makes the first process that reaches that line send SIGTERM to its whole
process group there, as slurmstepd signals every process of a job: a moment of the run that a
test cannot hit from outside (tests/test_preemption.py's SIGTERM during an evaluation)."""
import atexit
import json
import os
import signal
import sys
import threading

lines: dict[str, set[int]] = {}
for spec in filter(None, os.environ.get("BREAKPOINTS", "").split(";")):
    path, _, line = spec.rpartition(":")
    lines.setdefault(path, set()).add(int(line))
sigterm_path, _, sigterm_line = os.environ.get("SIGTERM_AT", "").rpartition(":")
if sigterm_path:
    lines.setdefault(sigterm_path, set()).add(int(sigterm_line))
reached: set[str] = set()
paths: dict[str, str] = {}  # a code object's file name: its absolute path


def on_line(frame, event, arg):
    if event == "line" and frame.f_lineno in lines[paths[frame.f_code.co_filename]]:
        where = f"{paths[frame.f_code.co_filename]}:{frame.f_lineno}"
        if where == f"{sigterm_path}:{sigterm_line}" and where not in reached:
            os.killpg(os.getpgrp(), signal.SIGTERM)
        reached.add(where)
    return on_line


def on_call(frame, event, arg):
    """Line events for the files with breakpoints alone: elsewhere the run goes at its own pace."""
    name = frame.f_code.co_filename
    if name not in paths:
        paths[name] = os.path.abspath(name)
    return on_line if paths[name] in lines else None


def write() -> None:
    with open(os.path.join(os.environ["BREAKPOINTS_OUT"], f"{os.getpid()}.json"), "w") as f:
        json.dump({"rank": os.environ.get("RANK"), "reached": sorted(reached)}, f)


if lines:
    sys.settrace(on_call)
    threading.settrace(on_call)  # threads too (torch's TensorBoard writer, DDP's autograd threads)
    if "BREAKPOINTS_OUT" in os.environ:
        atexit.register(write)
