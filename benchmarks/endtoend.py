"""The end-to-end experiment: a whole training command timed as its user sees it, from typing it
to its exit (start-up, the image list and split, every epoch's training and evaluation, the
checkpoints, and what its options add: decoding for --cache or --device-augment, --report's
final report, --plots' pictures), on a folder of a given size; and its time to
an accuracy: the seed recipe's final one, the seed recipe trained in the same call, as a command
of its own (`python -m benchmarks.endtoend OPTIONS`, this module's own command line)."""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.accuracy import curve, first_reach
from benchmarks.instruments import ROOT, Run, data_of_size, median, write_result
from benchmarks.ours_recipe import ours_split, plan_of
from benchmarks.seed_recipe import train_seed
from utils import METRICS_FILE, exit_on_error, read_metrics

SEED = "the seed recipe"  # its runs' label; the target is its final accuracy
DEFINITIONS = {
    "wall_seconds": "from starting the command to its exit, as `time` would show it",
    "to_last_checkpoint_seconds": "from starting the command to the last write of last.pth (the final epoch's); "
                                  "after it come, when asked (--report, --plots), the final report on best.pth and "
                                  "the plots, then the exit",
    "epochs_seconds": "training plus evaluation over all epochs, from metrics.jsonl",
    "outside_epochs_seconds": "wall_seconds - epochs_seconds: interpreter start-up, the image list and split, "
                              "decoding for --cache/--device-augment, model set-up, checkpoints, the final report "
                              "and plots when asked (--report, --plots), and the exit",
    "import_seconds": "importing the launcher (and plots.py under --plots) in a fresh process, timed inside it "
                      "(measured after each run: the part of outside_epochs_seconds no change to the run itself can "
                      "cut)",
    "beyond_imports_seconds": "outside_epochs_seconds - import_seconds",
    "first_epoch_seconds": "training time of epoch 1 (cuDNN autotuning, compilation, loader start)",
    "data_wait_share": "seconds the training loop waited for batches over all epochs / training seconds",
    "train_images_per_sec": "median over epochs 2 onwards of each epoch's training images/s",
    "curve": "per epoch: [seconds from starting the command to the moment its epoch line came out on stdout (after "
             "the epoch's evaluation; stamped here as it arrives through the pipe), validation accuracy (an --ema "
             "run's: the average's)]",
    "final_val_acc": "the last epoch's validation accuracy (an --ema run's: the average's)",
    "target_val_acc": "the seed recipe's final validation accuracy, median over its runs in this call",
    "to_target_seconds": "from starting the command to the line of its first epoch whose validation accuracy "
                         "reaches target_val_acc (the curve's seconds); null: not reached",
    SEED: "benchmarks/seed_recipe.py's train_seed as a command of its own (python -m benchmarks.endtoend), one "
          "process, on the same folder, split, epochs, image size and batch size as ours; it writes metrics.jsonl "
          "at its end but no checkpoints (the original saved its weights every epoch), and has no final report",
}
LAUNCHERS = {"single": "train_single_gpu", "spawn": "train_multi_gpu_using_spawn", "torchrun": "train_multi_gpu_using_launch"}
# The seed recipe's runs lack the ones its loop does not measure, or it does not do (checkpoints).
SUMMARY_KEYS = ("final_val_acc", "wall_seconds", "to_last_checkpoint_seconds", "epochs_seconds",
                "outside_epochs_seconds", "import_seconds", "beyond_imports_seconds", "first_epoch_seconds",
                "train_images_per_sec", "data_wait_share")
EPOCH_LINE = re.compile(r"(?:seed )?epoch (\d+)/\d+: ")  # ours (run_folder.epoch_line) and the seed recipe's


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


def import_seconds(tree: Path, launcher: str, plots: bool = False) -> float:
    """Seconds a fresh process takes to import what the run imports, timed inside it (neither the
    interpreter's start nor its exit): the launcher, and plots.py for `plots` (--plots; a launcher
    from before they became an option imports it itself)."""
    modules = LAUNCHERS[launcher] + (", plots" if plots else "")
    code = f"import time; t = time.perf_counter(); import {modules}; print(time.perf_counter() - t)"
    return float(subprocess.run([sys.executable, "-c", code], cwd=tree, check=True, capture_output=True,
                                text=True).stdout)


def time_command(cmd: list[str], out_dir: Path, tree: Path = ROOT, ours: bool = True) -> dict[str, Any]:
    """Run one training command to its end: its wall clock, when each epoch's line came out, and what
    its metrics.jsonl says. `ours`: a launcher's run, with checkpoints and its loader's waiting measured."""
    print("$ " + shlex.join(["python", *cmd[1:]]), flush=True)
    with tempfile.TemporaryFile("w+") as stderr:
        started, started_wall = time.perf_counter(), time.time()
        proc = subprocess.Popen(cmd, cwd=tree, env={**os.environ, "TQDM_DISABLE": "1"}, stdout=subprocess.PIPE,
                                stderr=stderr, text=True, bufsize=1)
        lines = [(time.perf_counter() - started, line.rstrip("\n")) for line in proc.stdout]
        returncode = proc.wait()
        wall = time.perf_counter() - started
        if returncode != 0:
            stderr.seek(0)
            raise RuntimeError(f"exit {returncode}: {stderr.read().strip().splitlines()[-1:]}")
    records = read_metrics(out_dir)
    train = sum(r["epoch_seconds"] for r in records)
    epochs = train + sum(r["eval_seconds"] for r in records)
    accuracies = epoch_curve(lines, records)
    measured = {
        "wall_seconds": round(wall, 2),
        "final_val_acc": accuracies[-1][1],
        "curve": accuracies,
        "epochs_seconds": round(epochs, 2),
        "outside_epochs_seconds": round(wall - epochs, 2),
        "first_epoch_seconds": round(records[0]["epoch_seconds"], 2),
        "epochs": len(records),
        # Each epoch's (train_loss, val_loss): two checkouts that must train alike compare equal here.
        "losses": [[r["train_loss"], r["val_loss"]] for r in records],
    }
    if not ours:
        return measured
    stdout = [line for _, line in lines]
    return {
        **measured,
        "to_last_checkpoint_seconds": round((out_dir / "last.pth").stat().st_mtime - started_wall, 2),
        "data_wait_share": round(sum(r["data_wait_seconds"] for r in records) / train, 4),
        "train_images_per_sec": round(statistics.median(r["train_images_per_sec"] for r in records[1:] or records), 1),
        "startup_lines": [line for line in stdout if line.startswith(("device augment:", "cache:"))],
        "time_line": next((line for line in stdout if line.startswith("time:")), None),
    }


def epoch_curve(lines: list[tuple[float, str]], records: list[dict[str, Any]]) -> list[list[float]]:
    """[seconds from the command's start to its epoch line, validation accuracy] per epoch of
    `records`; `lines`: the command's stdout, each line with the seconds at which it came out.
    The accuracy is the one the accuracy experiment judges (curve: an --ema run's average's)."""
    printed = {int(m[1]): seconds for seconds, line in lines if (m := EPOCH_LINE.match(line))}
    return [[round(printed[r["epoch"]], 2), acc] for r, (_, acc) in zip(records, curve(records))]


def mark_time_to_target(measurements: list[dict[str, Any]]) -> float | None:
    """Each successful run's to_target_seconds, against the seed recipe's final accuracy (the
    median over its runs here), which it returns; None, and no marks, without a seed run."""
    target = median(m["final_val_acc"] for m in measurements if m["options"] == SEED and "error" not in m)
    for m in measurements:
        if target is not None and "error" not in m:
            m["to_target_seconds"] = first_reach(m["curve"], target)
    return target


def summarise(label: str, runs: list[dict[str, Any]], target: float | None) -> dict[str, Any]:
    """The medians of one configuration's successful runs; the time to the target is the median of
    the runs that reached it, and how many did not is said."""
    if not runs:
        return {"options": label, "error": "no run succeeded"}
    row = {"options": label, "runs": len(runs), **{k: median(r[k] for r in runs) for k in SUMMARY_KEYS if k in runs[0]}}
    if target is not None:
        reached = [r["to_target_seconds"] for r in runs if r["to_target_seconds"] is not None]
        row.update(to_target_seconds=median(reached), runs_not_reaching_target=len(runs) - len(reached))
    return row


def to_target_cell(row: dict[str, Any]) -> str:
    if "runs_not_reaching_target" not in row:
        return "–"
    if row["to_target_seconds"] is None:
        return "not reached"
    missed = row["runs_not_reaching_target"]
    return f"{row['to_target_seconds']:.1f}" + (f" (not reached in {missed} of {row['runs']})" if missed else "")


def report_table(result: dict[str, Any]) -> str:
    target = result["target_val_acc"]
    lines = [f"target: {SEED}'s final validation accuracy, {target:.4f}" if target is not None
             else f"target: none ({SEED} did not run)",
             "| configuration | final val acc | to target s | wall s (median) | to last checkpoint s | epochs s "
             "| outside epochs s | importing s | outside less importing s | epoch 1 s | img/s | waiting for data |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    formats = {"final_val_acc": "{:.4f}", "wall_seconds": "{:.1f}", "to_last_checkpoint_seconds": "{:.1f}",
               "epochs_seconds": "{:.1f}", "outside_epochs_seconds": "{:.1f}", "import_seconds": "{:.1f}",
               "beyond_imports_seconds": "{:.1f}", "first_epoch_seconds": "{:.1f}", "train_images_per_sec": "{:.0f}"}
    for row in result["summary"]:
        name = row["options"] if row["options"] == SEED else f"`{row['options'] or '(defaults)'}`"
        if "error" in row:
            lines.append(f"| {name} | {row['error']} |" + " |" * 10)
            continue
        cells = [formats[k].format(row[k]) if k in row else "–" for k in formats]
        wait = f"{100 * row['data_wait_share']:.1f}%" if "data_wait_share" in row else "–"
        lines.append(f"| {name} | {cells[0]} | {to_target_cell(row)} | " + " | ".join(cells[1:]) + f" | {wait} |")
    return "\n".join(lines)


def run_line(record: dict[str, Any]) -> str:
    """What one finished run printed: its time, and where it went."""
    if record["options"] == SEED:
        return f"{record['wall_seconds']:.1f}s, final val acc {record['final_val_acc']:.4f}"
    return (f"{record['wall_seconds']:.1f}s ({record['outside_epochs_seconds']:.1f}s outside the epochs, "
            f"{record['beyond_imports_seconds']:.1f}s of it beyond importing), "
            f"{100 * record['data_wait_share']:.1f}% waiting for data, final val acc {record['final_val_acc']:.4f}")


def endtoend(args: argparse.Namespace) -> dict[str, Any]:
    """The `endtoend` command: the seed recipe, then each set of options in each checkout,
    --repeats times, interleaved; medians. The result is written after every run, so a limit
    loses at most one."""
    run = Run("endtoend", args.machine)
    trees = args.tree or [("", ROOT)]
    # options None: the seed recipe, from this checkout (it is frozen: every checkout's is the same).
    configurations = [(SEED, ROOT, None)] if args.seed_recipe else []
    configurations += [(f"{name}: {options}" if name else options, tree, options)
                       for name, tree in trees for options in args.variant or [""]]
    nproc = args.nproc or (1 if args.launcher == "single" else 2)
    measurements: list[dict[str, Any]] = []
    settings = {"data_path": args.data_path, "images": args.images, "epochs": args.epochs, "img_size": args.img_size,
                "batch_size": args.batch_size, "repeats": args.repeats, "launcher": args.launcher, "nproc": nproc,
                "trees": {name: str(tree) for name, tree in trees}, "variants": args.variant or [""],
                "seed_recipe": args.seed_recipe}

    def result() -> dict[str, Any]:
        target = mark_time_to_target(measurements)
        summary = [summarise(label, [m for m in measurements if m["options"] == label and "error" not in m], target)
                   for label, _, _ in configurations]
        return run.result(settings, definitions=DEFINITIONS, target_val_acc=target, summary=summary,
                          measurements=measurements)

    with tempfile.TemporaryDirectory() as tmp, data_of_size(args.data_path, args.images) as (data, pictures):
        settings["source_pictures"] = pictures
        for repeat in range(args.repeats):
            order = configurations if repeat % 2 == 0 else configurations[::-1]
            for i, (label, tree, options) in enumerate(order):
                out = Path(tmp) / f"run-{repeat}-{i}"
                common = ["--data-path", str(Path(data).resolve()), "--output-dir", str(out), "--epochs",
                          str(args.epochs), "--img-size", str(args.img_size), "--batch-size", str(args.batch_size)]
                record: dict[str, Any] = {"options": label, "repeat": repeat + 1}
                try:
                    if options is None:
                        cmd = [sys.executable, "-m", "benchmarks.endtoend", *common]
                        record.update(time_command(cmd, out, ROOT, ours=False))
                    else:
                        cmd = [*launcher_command(args.launcher, nproc), *common, *shlex.split(options)]
                        record.update(time_command(cmd, out, tree))
                        plots = "--plots" in shlex.split(options)
                        record["import_seconds"] = round(import_seconds(tree, args.launcher, plots), 2)
                        record["beyond_imports_seconds"] = round(record["outside_epochs_seconds"]
                                                                 - record["import_seconds"], 2)
                except Exception as e:  # noqa: BLE001 (one failing set of options must not lose the others' numbers)
                    record["error"] = f"{type(e).__name__}: {e}"
                    print(f"error: {label or '(defaults)'}: {record['error']}", file=sys.stderr, flush=True)
                else:
                    print(f"[{repeat + 1}/{args.repeats}] {label or '(defaults)'}: {run_line(record)}", flush=True)
                measurements.append(record)
                shutil.rmtree(out, ignore_errors=True)
                Path(args.out).parent.mkdir(parents=True, exist_ok=True)
                Path(args.out).write_text(json.dumps(result(), indent=1) + "\n")  # kept if a later run is cut off
    final = result()
    write_result(final, args.out, report_table(final))
    return final


def train_seed_recipe(argv: list[str]) -> None:
    """`python -m benchmarks.endtoend OPTIONS`: the seed recipe (seed_recipe.train_seed) as a
    command of its own, so that its clock starts, as ours does, with the interpreter. It reads the
    launchers' options (the data, split, epochs, image size, batch size and output folder are what
    it uses), prints each epoch's line as the epoch ends and writes metrics.jsonl at its end."""
    plan = plan_of(argv)
    records = train_seed(plan.args, ours_split(plan), lambda line: print(line, flush=True))
    out = Path(plan.args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / METRICS_FILE).write_text("".join(json.dumps(r) + "\n" for r in records))


if __name__ == "__main__":
    exit_on_error(train_seed_recipe)(sys.argv[1:])
