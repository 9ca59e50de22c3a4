"""The accuracy experiment: the seed recipe and ours trained from scratch on the same split,
their validation accuracy per epoch."""
from __future__ import annotations

import argparse
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.instruments import PLOT_DPI, ROOT, Run, command_line, new_figure, write_result
from benchmarks.ours_recipe import ours_plan
from benchmarks.seed_recipe import train_seed
from multi_train_utils.distributed_utils import DistContext
from multi_train_utils.loaders import readable_split
from utils import read_metrics


def train_ours(args: argparse.Namespace, options: list[str], out_dir: Path) -> tuple[list[dict[str, Any]], str]:
    """Our defaults (plus `options`) through the real launcher, on the settings the seed recipe
    gets; its metrics.jsonl is the result. Returns that and the command, as a user would type it."""
    cmd = ["train_single_gpu.py", "--data-path", args.data_path, "--img-size", str(args.img_size),
           "--epochs", str(args.epochs), "--batch-size", str(args.batch_size), "--seed", str(args.seed),
           "--output-dir", str(out_dir), *options]
    print("$ " + shlex.join(["python", *cmd]), flush=True)
    subprocess.run([sys.executable, *cmd], cwd=ROOT, check=True)
    return read_metrics(out_dir), shlex.join(["python", *cmd])


def recipe_summary(records: list[dict[str, Any]], wall_seconds: float, command: str) -> dict[str, Any]:
    """One recipe's result: its accuracy at the end, at best and over the last epochs, and its times."""
    accs = [r["val_acc"] for r in records]
    return {
        "command": command,
        "final_val_acc": accs[-1],
        "best_val_acc": max(accs),
        "last3_mean_val_acc": statistics.fmean(accs[-3:]),
        "val_acc_per_epoch": accs,
        "train_seconds": round(sum(r["epoch_seconds"] for r in records), 1),
        "eval_seconds": round(sum(r["eval_seconds"] for r in records), 1),
        "wall_seconds": round(wall_seconds, 1),
        "epochs": records,
    }


def accuracy(args: argparse.Namespace) -> dict[str, Any]:
    """The `accuracy` command: the seed in this process, ours and its variants through the launcher."""
    run = Run("accuracy", args.machine)
    runs_dir = Path(args.runs_dir or f"runs/benchmark-accuracy-{time.strftime('%Y%m%d-%H%M%S')}")
    plan = ours_plan(args.data_path, args.img_size, args.batch_size, ["--epochs", str(args.epochs),
                                                                      "--seed", str(args.seed)])
    split = readable_split(plan, DistContext.single())
    recipes: dict[str, dict[str, Any]] = {}
    if not args.skip_seed:
        t0 = time.perf_counter()
        records = train_seed(plan.args, split, lambda line: print(line, flush=True))
        recipes["seed"] = recipe_summary(records, time.perf_counter() - t0,
                                         f"{command_line()}  (the seed recipe, in-process)")
    variants = [("ours", [])] + [(f"ours {v}", shlex.split(v)) for v in args.variant]
    for name, options in variants:
        out_dir = runs_dir / name.replace(" ", "").replace("--", "_")
        t0 = time.perf_counter()
        records, cmd = train_ours(args, options, out_dir)
        recipes[name] = recipe_summary(records, time.perf_counter() - t0, cmd)
    settings = {"data_path": args.data_path, "img_size": args.img_size, "epochs": args.epochs,
                "batch_size": args.batch_size, "val_rate": plan.args.val_rate, "seed": plan.args.seed,
                "train_images": len(split.train), "val_images": len(split.val), "runs_dir": str(runs_dir)}
    result = run.result(settings, recipes=recipes)
    if "seed" in recipes:
        seed_acc = recipes["seed"]["final_val_acc"]
        result["points_above_seed"] = {name: round(100 * (r["final_val_acc"] - seed_acc), 2)
                                       for name, r in recipes.items() if name != "seed"}
    table = ["| recipe | final val acc | best | mean of last 3 | train s | wall s |", "|---|---|---|---|---|---|"]
    table += [f"| {name} | {100 * r['final_val_acc']:.1f}% | {100 * r['best_val_acc']:.1f}% | "
              f"{100 * r['last3_mean_val_acc']:.1f}% | {r['train_seconds']:.0f} | {r['wall_seconds']:.0f} |"
              for name, r in recipes.items()]
    write_result(result, args.out, "\n".join(table), plot_accuracy)
    return result


def plot_accuracy(result: dict[str, Any], path: Path) -> None:
    """Validation accuracy per epoch, one line per recipe."""
    fig = new_figure(7, 4.2)
    if fig is None:
        return
    ax = fig.subplots()
    for name, r in result["recipes"].items():
        accs = r["val_acc_per_epoch"]
        ax.plot(range(1, len(accs) + 1), [100 * a for a in accs], "o-", markersize=3,
                label=f"{name}: final {100 * accs[-1]:.1f}%")
    s = result["settings"]
    ax.set(xlabel="epoch", ylabel="validation accuracy (%)",
           title=f"{s['train_images']} training / {s['val_images']} validation images, {s['img_size']} px, from scratch\n"
                 f"{result['machine']['name']}")
    ax.title.set_fontsize(9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=PLOT_DPI)
