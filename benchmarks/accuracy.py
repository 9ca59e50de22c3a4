"""The accuracy experiment: the seed recipe and ours (and variants of ours) trained from scratch
on the same split, seed after seed; validation accuracy against wall-clock time, and how soon
each of ours first reaches the seed recipe's final accuracy. With --budgets, ours trains under
--time-budget, given shares of the time the seed recipe's run of the same seed took: what a
user with that much time gets."""
from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.instruments import PLOT_DPI, ROOT, Run, command_line, new_figure, write_result
from benchmarks.ours_recipe import ours_plan, ours_split
from benchmarks.seed_recipe import train_seed
from utils import UserError, read_metrics


def train_ours(args: argparse.Namespace, seed: int, options: list[str], out_dir: Path) -> tuple[list[dict[str, Any]], str]:
    """Our defaults (plus `options`) through the real launcher, on the settings the seed recipe
    gets (its epoch count unless `options` give a --time-budget, which then decides alone); its
    metrics.jsonl is the result. Returns that and the command, as a user would type it."""
    epochs = [] if "--time-budget" in options else ["--epochs", str(args.epochs)]
    cmd = ["train_single_gpu.py", "--data-path", args.data_path, "--img-size", str(args.img_size),
           *epochs, "--batch-size", str(args.batch_size), "--seed", str(seed), "--output-dir", str(out_dir), *options]
    print("$ " + shlex.join(["python", *cmd]), flush=True)
    subprocess.run([sys.executable, *cmd], cwd=ROOT, check=True)
    return read_metrics(out_dir), shlex.join(["python", *cmd])


def curve(records: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """(seconds of training and evaluation so far, validation accuracy) after each epoch. A run
    that keeps a weight average (--ema) is judged by the average's accuracy, decided in
    advance rather than picked per epoch."""
    seconds, points = 0.0, []
    for r in records:
        seconds += r["epoch_seconds"] + r["eval_seconds"]
        points.append((round(seconds, 1), r.get("ema_val_acc", r["val_acc"])))
    return points


def first_reach(points: list[tuple[float, float]], accuracy: float) -> float | None:
    """Seconds until the curve first reaches `accuracy`, or None."""
    return next((t for t, acc in points if acc >= accuracy), None)


def spread(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values), "n": len(values)}


def final_acc(run: dict[str, Any]) -> float:
    """A run's validation accuracy after its last epoch (its curve: (seconds, accuracy) per epoch)."""
    return run["curve"][-1][1]


def summarise(runs: dict[str, dict[int, dict[str, Any]]]) -> dict[str, Any]:
    """Per recipe over seeds: final accuracy, time, and (for ours) the time to the seed
    recipe's final accuracy of the same seed, as a share of the seed recipe's time."""
    summary = {}
    for name, by_seed in runs.items():
        finals = [final_acc(r) for r in by_seed.values()]
        entry = {"final_val_acc": spread(finals), "seconds": spread([r["curve"][-1][0] for r in by_seed.values()])}
        if name != "seed" and "seed" in runs:
            shares, missed = [], 0
            for seed, r in by_seed.items():
                target = runs["seed"][seed]["curve"]
                reached = first_reach(r["curve"], target[-1][1])
                if reached is None:
                    missed += 1
                else:
                    shares.append(reached / target[-1][0])
            entry["points_above_seed"] = spread([100 * (final_acc(r) - final_acc(runs["seed"][s]))
                                                 for s, r in by_seed.items()])
            entry["time_to_seed_accuracy_share"] = spread(shares) if shares else None
            entry["seeds_never_reaching_seed_accuracy"] = missed
            entry["seeds_ending_at_or_above_seed"] = sum(final_acc(r) >= final_acc(runs["seed"][s])
                                                         for s, r in by_seed.items())
        summary[name] = entry
    return summary


def accuracy(args: argparse.Namespace) -> dict[str, Any]:
    """The `accuracy` command: for each seed, the seed recipe in this process, then ours and its
    variants through the launcher, one run at a time."""
    run = Run("accuracy", args.machine)
    runs_dir = Path(args.runs_dir or f"runs/benchmark-accuracy-{time.strftime('%Y%m%d-%H%M%S')}")
    if args.budgets and args.skip_seed:
        raise UserError("--budgets are shares of the seed recipe's time: they need its runs (no --skip-seed)")
    if args.seed_runs and args.skip_seed:
        raise UserError("--seed-runs gives the seed recipe's runs; --skip-seed leaves them out: choose one")
    variants = [("ours", [])] + [(f"ours {v}", shlex.split(v)) for v in args.variant]
    runs: dict[str, dict[int, dict[str, Any]]] = {name: {} for name in ([] if args.skip_seed else ["seed"])}
    runs.update({name: {} for name, _, _ in budgeted(variants, args, 0.0)})
    settings: dict[str, Any] = {}
    for seed in args.seeds:
        plan = ours_plan(args.data_path, args.img_size, args.batch_size, ["--epochs", str(args.epochs),
                                                                          "--seed", str(seed)])
        split = ours_split(plan)  # the one the launcher draws for ours' run of this seed
        settings = {"data_path": args.data_path, "img_size": args.img_size, "epochs": args.epochs,
                    "batch_size": args.batch_size, "val_rate": plan.args.val_rate, "seeds": args.seeds,
                    "train_images": len(split.train), "val_images": len(split.val), "runs_dir": str(runs_dir)}
        recorded = recorded_seed_run(args.seed_runs, settings, seed) if args.seed_runs else None
        if recorded:
            runs["seed"][seed] = recorded
        elif not args.skip_seed:
            records = train_seed(plan.args, split, lambda line: print(line, flush=True))
            runs["seed"][seed] = {"command": f"{command_line()}  (the seed recipe, in-process)",
                                  "curve": curve(records), "epochs": records}
        seed_seconds = runs["seed"][seed]["curve"][-1][0] if not args.skip_seed else 0.0
        for name, options, share in budgeted(variants, args, seed_seconds):
            out_dir = runs_dir / f"{name.replace(' ', '').replace('--', '_').replace('@', '-')}-seed{seed}"
            records, cmd = train_ours(args, seed, options, out_dir)
            runs[name][seed] = {"command": cmd, "curve": curve(records), "epochs": records, "budget_share": share}
        # Written after every seed: a long experiment cut short keeps the seeds it finished.
        summary = summarise(runs)
        result = run.result({**settings, "seeds": args.seeds[: args.seeds.index(seed) + 1], "budgets": args.budgets,
                             "variant_budgets": variant_budgets(args)}, summary=summary, runs=runs)
        write_result(result, args.out, report_table(summary), plot_budgets if args.budgets else plot_accuracy)
    return result


def recorded_seed_run(path: str, settings: dict[str, Any], seed: int) -> dict[str, Any] | None:
    """The seed recipe's run of `seed` from an earlier result of this benchmark (None when it has
    none: that seed is trained), which must have trained with the same settings on a folder of
    the same size (the result does not name the folder: that it is the same one is the caller's
    word). The seed recipe is deterministic on the CPU, so only its seconds would differ in a new
    run, and screening ours' options need not pay for its epochs again."""
    earlier = json.loads(Path(path).read_text())
    same = ("img_size", "epochs", "batch_size", "val_rate", "train_images", "val_images")
    differ = [k for k in same if earlier["settings"].get(k) != settings[k]]
    if differ:
        raise UserError(f"--seed-runs {path} trained with other settings: "
                        + ", ".join(f"{k} {earlier['settings'].get(k)} (here {settings[k]})" for k in differ))
    recorded = earlier["runs"].get("seed", {}).get(str(seed))
    return recorded and {**recorded, "recorded_in": f"{path} (git {earlier['machine'].get('git_commit', '?')[:7]})"}


def variant_budgets(args: argparse.Namespace) -> list[float]:
    return args.variant_budgets or args.budgets


def budgeted(variants: list[tuple[str, list[str]]], args: argparse.Namespace,
             seed_seconds: float) -> list[tuple[str, list[str], float | None]]:
    """The runs of one seed: each variant as it is or, with --budgets, once per budget, as
    (name, options, share of the seed recipe's time). Ours takes --budgets, the others
    --variant-budgets."""
    if not args.budgets:
        return [(name, options, None) for name, options in variants]
    return [(f"{name} @{share:g}", [*options, "--time-budget", f"{share * seed_seconds:.1f}"], share)
            for i, (name, options) in enumerate(variants)
            for share in (args.budgets if i == 0 else variant_budgets(args))]


def report_table(summary: dict[str, Any]) -> str:
    def pm(s: dict[str, float], scale: float = 100, digits: int = 1) -> str:
        return f"{scale * s['mean']:.{digits}f} ± {scale * s['std']:.{digits}f}"

    lines = ["| recipe | final val acc (%) | vs seed (points) | seeds ending ≥ seed | seconds | time to seed's final acc |",
             "|---|---|---|---|---|---|"]
    for name, s in summary.items():
        share = s.get("time_to_seed_accuracy_share")
        reach = "" if name == "seed" else (f"{pm(share, digits=0)}% of seed's" if share else "never")
        if s.get("seeds_never_reaching_seed_accuracy"):
            reach += f" (never on {s['seeds_never_reaching_seed_accuracy']} seed(s))"
        above = pm(s["points_above_seed"], scale=1) if "points_above_seed" in s else ""
        ending = f"{s['seeds_ending_at_or_above_seed']} of {s['final_val_acc']['n']}" if "points_above_seed" in s else ""
        lines.append(f"| {name} | {pm(s['final_val_acc'])} | {above} | {ending} | {pm(s['seconds'], scale=1, digits=0)} "
                     f"| {reach} |")
    return "\n".join(lines)


def plot_budgets(result: dict[str, Any], path: Path) -> None:
    """Final validation accuracy against the time given, as a share of the seed recipe's: one
    line per recipe (mean over seeds, with the spread), the seed recipe's 30 epochs a band.
    With one share only, the recipes side by side instead, each seed a point."""
    fig = new_figure(7.5, 4.5)
    if fig is None:
        return
    ax = fig.subplots()
    summary, recipes = result["summary"], {}
    for name, by_seed in result["runs"].items():
        if name != "seed":
            share = next(iter(by_seed.values()))["budget_share"]
            recipes.setdefault(name.rpartition(" @")[0], []).append((100 * share, name))
    seed = summary["seed"]["final_val_acc"]
    ax.axhspan(100 * (seed["mean"] - seed["std"]), 100 * (seed["mean"] + seed["std"]), color="0.85")
    ax.axhline(100 * seed["mean"], color="0.4", label=f"seed recipe, {result['settings']['epochs']} epochs "
                                                      f"(100% of the time), mean ± std")
    shares_given = sorted({share for points in recipes.values() for share, _ in points})
    for i, (name, points) in enumerate(recipes.items()):
        shares, runs = zip(*sorted(points))
        accs = [summary[run]["final_val_acc"] for run in runs]
        if len(shares_given) == 1:  # one x per recipe: its seeds, and their mean ± std
            finals = [100 * final_acc(r) for r in result["runs"][runs[0]].values()]
            ax.plot([i] * len(finals), finals, ".", color=f"C{i}", alpha=0.5)
            shares = (i,)
        ax.errorbar(shares, [100 * a["mean"] for a in accs], yerr=[100 * a["std"] for a in accs], fmt="o-",
                    color=f"C{i}", capsize=3, label=f"{name} with --time-budget")
    if len(shares_given) == 1:
        ax.set_xticks(range(len(recipes)), [name.removeprefix("ours ") or "ours" for name in recipes], fontsize=7,
                      rotation=15)
        ax.set_xlim(-0.5, len(recipes) - 0.5)
    s = result["settings"]
    given = (f"ours and its variants at {shares_given[0]:g}% of the seed recipe's time" if len(shares_given) == 1
             else "time given (% of the seed recipe's training and evaluation)")
    ax.set(xlabel=given, ylabel="final validation accuracy (%)",
           title=f"{s['train_images']} training / {s['val_images']} validation images, {s['img_size']} px, from "
                 f"scratch, seeds {', '.join(map(str, s['seeds']))}\n{result['machine']['name']}")
    ax.title.set_fontsize(9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.savefig(path, dpi=PLOT_DPI)


def plot_accuracy(result: dict[str, Any], path: Path) -> None:
    """Validation accuracy against seconds of training and evaluation: one line per recipe
    and seed, one colour per recipe."""
    fig = new_figure(7.5, 4.5)
    if fig is None:
        return
    ax = fig.subplots()
    for i, (name, by_seed) in enumerate(result["runs"].items()):
        for j, r in enumerate(by_seed.values()):
            seconds, accs = zip(*r["curve"])
            ax.plot(seconds, [100 * a for a in accs], "-", color=f"C{i}", alpha=0.7, linewidth=1,
                    label=f"{name} ({100 * result['summary'][name]['final_val_acc']['mean']:.1f}% mean final)"
                    if j == 0 else None)
    s = result["settings"]
    ax.set(xlabel="seconds of training and evaluation", ylabel="validation accuracy (%)",
           title=f"{s['train_images']} training / {s['val_images']} validation images, {s['img_size']} px, "
                 f"{s['epochs']} epochs, from scratch, seeds {', '.join(map(str, s['seeds']))}\n"
                 f"{result['machine']['name']}")
    ax.title.set_fontsize(9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.savefig(path, dpi=PLOT_DPI)
