"""The end-to-end experiment: a whole training command timed as its user sees it, from typing it
to its exit (start-up, the image list and split, decoding, every epoch's training and
evaluation, the checkpoints and the final report), on a folder of a given size."""
from __future__ import annotations

import argparse
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.instruments import ROOT, Run, data_of_size, write_result
from utils import read_metrics

DEFINITIONS = {
    "wall_seconds": "from starting the command to its exit, as `time` would show it",
    "to_last_checkpoint_seconds": "from starting the command to the last write of last.pth (the final epoch's); "
                                  "after it come the final report on best.pth and the plots",
    "epochs_seconds": "training plus evaluation over all epochs, from metrics.jsonl",
    "outside_epochs_seconds": "wall_seconds - epochs_seconds: interpreter start-up, the image list and split, "
                              "decoding for --cache/--device-augment, model set-up, the final report and plots",
    "first_epoch_seconds": "training time of epoch 1 (cuDNN autotuning, compilation, loader start)",
    "data_wait_share": "seconds the training loop waited for batches over all epochs / training seconds",
    "train_images_per_sec": "median over epochs 2 onwards of each epoch's training images/s",
}


def time_command(cmd: list[str], out_dir: Path) -> dict[str, Any]:
    """Run one training command to its end; its wall clock and what its metrics.jsonl says."""
    print("$ " + shlex.join(["python", *cmd[1:]]), flush=True)
    started, started_wall = time.perf_counter(), time.time()
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "TQDM_DISABLE": "1"}, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise RuntimeError(f"exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}")
    records = read_metrics(out_dir)
    train = sum(r["epoch_seconds"] for r in records)
    epochs = train + sum(r["eval_seconds"] for r in records)
    return {
        "wall_seconds": round(wall, 2),
        "to_last_checkpoint_seconds": round((out_dir / "last.pth").stat().st_mtime - started_wall, 2),
        "epochs_seconds": round(epochs, 2),
        "outside_epochs_seconds": round(wall - epochs, 2),
        "first_epoch_seconds": round(records[0]["epoch_seconds"], 2),
        "data_wait_share": round(sum(r["data_wait_seconds"] for r in records) / train, 4),
        "train_images_per_sec": round(statistics.median(r["train_images_per_sec"] for r in records[1:] or records), 1),
        "epochs": len(records),
        "startup_lines": [line for line in proc.stdout.splitlines() if line.startswith(("device augment:", "cache:"))],
    }


def summarise(options: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The medians of one set of options' successful runs."""
    if not runs:
        return {"options": options, "error": "no run succeeded"}
    keys = ("wall_seconds", "to_last_checkpoint_seconds", "epochs_seconds", "outside_epochs_seconds",
            "first_epoch_seconds", "train_images_per_sec", "data_wait_share")
    return {"options": options, "runs": len(runs), **{k: statistics.median(r[k] for r in runs) for k in keys}}


def report_table(result: dict[str, Any]) -> str:
    lines = ["| options | wall s (median) | to last checkpoint s | epochs s | outside epochs s | epoch 1 s | img/s "
             "| waiting for data |", "|---|---|---|---|---|---|---|---|"]
    for row in result["summary"]:
        if "error" in row:
            lines.append(f"| `{row['options'] or '(defaults)'}` | {row['error']} |" + " |" * 6)
            continue
        lines.append(f"| `{row['options'] or '(defaults)'}` | {row['wall_seconds']:.1f} | "
                     f"{row['to_last_checkpoint_seconds']:.1f} | {row['epochs_seconds']:.1f} | "
                     f"{row['outside_epochs_seconds']:.1f} | {row['first_epoch_seconds']:.1f} | "
                     f"{row['train_images_per_sec']:.0f} | {100 * row['data_wait_share']:.1f}% |")
    return "\n".join(lines)


def endtoend(args: argparse.Namespace) -> dict[str, Any]:
    """The `endtoend` command: each set of options, --repeats times, interleaved; medians."""
    run = Run("endtoend", args.machine)
    variants = args.variant or [""]
    measurements = []
    with tempfile.TemporaryDirectory() as tmp, data_of_size(args.data_path, args.images) as (data, pictures):
        for repeat in range(args.repeats):
            for i, options in enumerate(variants if repeat % 2 == 0 else variants[::-1]):
                out = Path(tmp) / f"run-{repeat}-{i}"
                cmd = [sys.executable, "train_single_gpu.py", "--data-path", str(data), "--output-dir", str(out),
                       "--epochs", str(args.epochs), "--img-size", str(args.img_size),
                       "--batch-size", str(args.batch_size), *shlex.split(options)]
                record: dict[str, Any] = {"options": options, "repeat": repeat + 1}
                try:
                    record.update(time_command(cmd, out))
                except Exception as e:  # noqa: BLE001 (one failing set of options must not lose the others' numbers)
                    record["error"] = f"{type(e).__name__}: {e}"
                    print(f"error: {options or '(defaults)'}: {record['error']}", file=sys.stderr, flush=True)
                else:
                    print(f"[{repeat + 1}/{args.repeats}] {options or '(defaults)'}: {record['wall_seconds']:.1f}s "
                          f"({record['outside_epochs_seconds']:.1f}s outside the epochs), "
                          f"{100 * record['data_wait_share']:.1f}% waiting for data", flush=True)
                measurements.append(record)
                shutil.rmtree(out, ignore_errors=True)
    summary = [summarise(options, [m for m in measurements if m["options"] == options and "error" not in m])
               for options in variants]
    settings = {"data_path": args.data_path, "images": args.images, "source_pictures": pictures,
                "epochs": args.epochs, "img_size": args.img_size, "batch_size": args.batch_size,
                "repeats": args.repeats, "variants": variants}
    result = run.result(settings, definitions=DEFINITIONS, summary=summary, measurements=measurements)
    write_result(result, args.out, report_table(result))
    return result
