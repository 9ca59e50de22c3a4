"""The end-to-end experiment: a whole training command timed as its user sees it, from typing it
to its exit (start-up, the image list and split, decoding, every epoch's training and
evaluation, the checkpoints and the final report), on a folder of a given size."""
from __future__ import annotations

import argparse
import json
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
                              "decoding for --cache/--device-augment, model set-up, checkpoints, the final report, "
                              "plots and the exit",
    "import_seconds": "importing the launcher and plots.py in a fresh process, timed inside it (measured "
                      "after each run: the part of outside_epochs_seconds no change to the run itself can cut)",
    "beyond_imports_seconds": "outside_epochs_seconds - import_seconds",
    "first_epoch_seconds": "training time of epoch 1 (cuDNN autotuning, compilation, loader start)",
    "data_wait_share": "seconds the training loop waited for batches over all epochs / training seconds",
    "train_images_per_sec": "median over epochs 2 onwards of each epoch's training images/s",
}
LAUNCHERS = {"single": "train_single_gpu", "spawn": "train_multi_gpu_using_spawn", "torchrun": "train_multi_gpu_using_launch"}
SUMMARY_KEYS = ("wall_seconds", "to_last_checkpoint_seconds", "epochs_seconds", "outside_epochs_seconds",
                "import_seconds", "beyond_imports_seconds", "first_epoch_seconds", "train_images_per_sec",
                "data_wait_share")


def tree_spec(text: str) -> tuple[str, Path]:
    """A --tree value: NAME=PATH, a checkout of this project (e.g. a `git worktree` of an older commit)."""
    name, _, path = text.partition("=")
    if not name or not path or not (Path(path) / "train_single_gpu.py").is_file():
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=PATH with PATH a checkout of this project")
    return name, Path(path).resolve()


def launcher_command(launcher: str, nproc: int) -> list[str]:
    """The start of a training command: each launcher as a user types it (torchrun as `python -m`, so
    that it runs with the same interpreter)."""
    if launcher == "single":
        return [sys.executable, "train_single_gpu.py"]
    if launcher == "spawn":
        return [sys.executable, "train_multi_gpu_using_spawn.py", "--world-size", str(nproc)]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
            "train_multi_gpu_using_launch.py"]


def import_seconds(tree: Path, launcher: str) -> float:
    """Seconds a fresh process takes to import the launcher and plots.py, timed inside it
    (neither the interpreter's start nor its exit)."""
    code = f"import time; t = time.perf_counter(); import {LAUNCHERS[launcher]}, plots; print(time.perf_counter() - t)"
    return float(subprocess.run([sys.executable, "-c", code], cwd=tree, check=True, capture_output=True,
                                text=True).stdout)


def time_command(cmd: list[str], out_dir: Path, tree: Path = ROOT) -> dict[str, Any]:
    """Run one training command to its end; its wall clock and what its metrics.jsonl says."""
    print("$ " + shlex.join(["python", *cmd[1:]]), flush=True)
    started, started_wall = time.perf_counter(), time.time()
    proc = subprocess.run(cmd, cwd=tree, env={**os.environ, "TQDM_DISABLE": "1"}, capture_output=True, text=True)
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
        # Each epoch's (train_loss, val_loss): two checkouts that must train alike compare equal here.
        "losses": [[r["train_loss"], r["val_loss"]] for r in records],
        "startup_lines": [line for line in proc.stdout.splitlines() if line.startswith(("device augment:", "cache:"))],
        "time_line": next((line for line in proc.stdout.splitlines() if line.startswith("time:")), None),
    }


def summarise(label: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The medians of one configuration's successful runs."""
    if not runs:
        return {"options": label, "error": "no run succeeded"}
    return {"options": label, "runs": len(runs), **{k: statistics.median(r[k] for r in runs) for k in SUMMARY_KEYS}}


def report_table(result: dict[str, Any]) -> str:
    lines = ["| configuration | wall s (median) | to last checkpoint s | epochs s | outside epochs s | importing s "
             "| outside less importing s | epoch 1 s | img/s | waiting for data |", "|---|---|---|---|---|---|---|---|---|---|"]
    for row in result["summary"]:
        if "error" in row:
            lines.append(f"| `{row['options'] or '(defaults)'}` | {row['error']} |" + " |" * 8)
            continue
        lines.append(f"| `{row['options'] or '(defaults)'}` | {row['wall_seconds']:.1f} | "
                     f"{row['to_last_checkpoint_seconds']:.1f} | {row['epochs_seconds']:.1f} | "
                     f"{row['outside_epochs_seconds']:.1f} | {row['import_seconds']:.1f} | "
                     f"{row['beyond_imports_seconds']:.1f} | {row['first_epoch_seconds']:.1f} | "
                     f"{row['train_images_per_sec']:.0f} | {100 * row['data_wait_share']:.1f}% |")
    return "\n".join(lines)


def endtoend(args: argparse.Namespace) -> dict[str, Any]:
    """The `endtoend` command: each set of options in each checkout, --repeats times,
    interleaved; medians. The result is written after every run, so a limit loses at most one."""
    run = Run("endtoend", args.machine)
    trees = args.tree or [("", ROOT)]
    configurations = [(name, tree, options) for name, tree in trees for options in args.variant or [""]]
    labels = [f"{name}: {options}" if name else options for name, _, options in configurations]
    nproc = args.nproc or (1 if args.launcher == "single" else 2)
    measurements: list[dict[str, Any]] = []
    settings = {"data_path": args.data_path, "images": args.images, "epochs": args.epochs, "img_size": args.img_size,
                "batch_size": args.batch_size, "repeats": args.repeats, "launcher": args.launcher, "nproc": nproc,
                "trees": {name: str(tree) for name, tree in trees}, "variants": args.variant or [""]}

    def result() -> dict[str, Any]:
        summary = [summarise(label, [m for m in measurements if m["options"] == label and "error" not in m])
                   for label in labels]
        return run.result(settings, definitions=DEFINITIONS, summary=summary, measurements=measurements)

    with tempfile.TemporaryDirectory() as tmp, data_of_size(args.data_path, args.images) as (data, pictures):
        settings["source_pictures"] = pictures
        for repeat in range(args.repeats):
            order = list(zip(labels, configurations))
            for i, (label, (_, tree, options)) in enumerate(order if repeat % 2 == 0 else order[::-1]):
                out = Path(tmp) / f"run-{repeat}-{i}"
                cmd = [*launcher_command(args.launcher, nproc), "--data-path", str(Path(data).resolve()),
                       "--output-dir", str(out), "--epochs", str(args.epochs), "--img-size", str(args.img_size),
                       "--batch-size", str(args.batch_size), *shlex.split(options)]
                record: dict[str, Any] = {"options": label, "repeat": repeat + 1}
                try:
                    record.update(time_command(cmd, out, tree))
                    record["import_seconds"] = round(import_seconds(tree, args.launcher), 2)
                    record["beyond_imports_seconds"] = round(record["outside_epochs_seconds"] - record["import_seconds"], 2)
                except Exception as e:  # noqa: BLE001 (one failing set of options must not lose the others' numbers)
                    record["error"] = f"{type(e).__name__}: {e}"
                    print(f"error: {label or '(defaults)'}: {record['error']}", file=sys.stderr, flush=True)
                else:
                    print(f"[{repeat + 1}/{args.repeats}] {label or '(defaults)'}: {record['wall_seconds']:.1f}s "
                          f"({record['outside_epochs_seconds']:.1f}s outside the epochs, "
                          f"{record['beyond_imports_seconds']:.1f}s of it beyond importing), "
                          f"{100 * record['data_wait_share']:.1f}% waiting for data", flush=True)
                measurements.append(record)
                shutil.rmtree(out, ignore_errors=True)
                Path(args.out).parent.mkdir(parents=True, exist_ok=True)
                Path(args.out).write_text(json.dumps(result(), indent=1) + "\n")  # kept if a later run is cut off
    final = result()
    write_result(final, args.out, report_table(final))
    return final
