"""The start-up experiment: how long a training command takes to reach its first step, and
the memory its process holds by then, for a new run (which lists and splits the folder) and
for a resume of it (which reads the split it recorded), on folders of several sizes."""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.instruments import ROOT, Run, data_of_size, write_result

DEFINITIONS = {
    "seconds_to_first_step": "from starting train_single_gpu.py to its 'training:' line, printed just before the first "
                             "step (interpreter start-up, listing and splitting the folder or reading the recorded "
                             "split, with --check-images decoding it, the model, the loaders)",
    "peak_rss_mb": "the training process's peak resident memory (VmHWM) at that line; loader workers not included",
    "per_10000_images": "the growth of seconds_to_first_step per 10,000 images, between the smallest and the largest folder",
}
READY = "training: "  # the line a run prints just before its first step


def catches_sigterm(pid: int) -> bool:
    """Whether process `pid` has a handler for SIGTERM (SigCgt in /proc/PID/status). A launcher
    sets its own just after the 'training:' line: a SIGTERM before it ends the run at once, unsaved."""
    status = Path(f"/proc/{pid}/status").read_text()
    caught = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
    return bool(caught >> (signal.SIGTERM - 1) & 1)


def first_step(cmd: list[str]) -> dict[str, float]:
    """Start `cmd`, wait for its first step, note the time and memory, then, once the run takes a
    SIGTERM as a request, stop it with one (it saves its position, which the resume measurement
    starts from)."""
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "TQDM_DISABLE": "1", "PYTHONUNBUFFERED": "1"})
    output = []
    for line in proc.stdout:
        output.append(line)
        if line.startswith(READY):
            seconds = time.perf_counter() - started
            status = Path(f"/proc/{proc.pid}/status").read_text()
            hwm = next(int(x.split()[1]) for x in status.splitlines() if x.startswith("VmHWM:")) / 1024
            while proc.poll() is None and not catches_sigterm(proc.pid):
                time.sleep(0.01)
            proc.send_signal(signal.SIGTERM)
            proc.communicate()
            return {"seconds_to_first_step": round(seconds, 2), "peak_rss_mb": round(hwm, 1),
                    "resumed": any(line.startswith("resumed from ") for line in output)}
    proc.wait()
    raise RuntimeError(f"exit {proc.returncode} before the first step: {''.join(output[-5:]).strip()}")


def startup(args: argparse.Namespace) -> dict[str, Any]:
    """The `startup` command."""
    run = Run("startup", args.machine)
    rows = []
    for images in args.images:
        with data_of_size(args.data_path, images) as (data, _), tempfile.TemporaryDirectory() as out:
            cmd = [sys.executable, "train_single_gpu.py", "--data-path", data, "--output-dir", out,
                   "--img-size", str(args.img_size), "--epochs", "1", *args.options]
            row: dict[str, Any] = {"images": images}
            row["new"] = first_step(cmd)
            row["resume"] = first_step([*cmd, "--resume", "auto"])
            if not row["resume"]["resumed"]:
                raise RuntimeError("the stopped run left nothing to resume from")
            rows.append(row)
            print(f"{images} images: new run {row['new']['seconds_to_first_step']:.1f}s "
                  f"({row['new']['peak_rss_mb']:.0f} MiB), resume {row['resume']['seconds_to_first_step']:.1f}s "
                  f"({row['resume']['peak_rss_mb']:.0f} MiB)", flush=True)
    growth = {}
    if len(rows) > 1:
        span = (rows[-1]["images"] - rows[0]["images"]) / 10_000
        growth = {kind: round((rows[-1][kind]["seconds_to_first_step"] - rows[0][kind]["seconds_to_first_step"]) / span, 2)
                  for kind in ("new", "resume")}
    result = run.result({"data_path": args.data_path, "images": args.images, "img_size": args.img_size,
                         "options": args.options}, definitions=DEFINITIONS, rows=rows, per_10000_images=growth)
    write_result(result, args.out, startup_table(result))
    return result


def startup_table(result: dict[str, Any]) -> str:
    lines = ["| images | new run: s to first step | new run: peak MiB | resume: s to first step | resume: peak MiB |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['images']:,} | {r['new']['seconds_to_first_step']:.1f} | {r['new']['peak_rss_mb']:.0f} | "
              f"{r['resume']['seconds_to_first_step']:.1f} | {r['resume']['peak_rss_mb']:.0f} |" for r in result["rows"]]
    if result["per_10000_images"]:
        g = result["per_10000_images"]
        lines.append(f"| per 10,000 more | +{g['new']:.2f} s | | +{g['resume']:.2f} s | |")
    return "\n".join(lines)
