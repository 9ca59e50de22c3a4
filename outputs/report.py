"""The evaluation report: per-class precision, recall and F1, top-k accuracy, the confusion
matrix and the most confidently wrong images, exact at any world size; made at the end of a run
for best.pth's weights, and by --eval-only.

Each rank counts its shard of the validation split; the counts are all-reduced once, and the
few mistakes each rank keeps are gathered once. report.json holds everything, so plots.py can
redraw the pictures from a finished run; confusion_matrix.csv is the matrix for spreadsheets.
"""
from __future__ import annotations

import argparse
import csv
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from multi_train_utils.checkpoint import load_checkpoint, shipped_weights
from multi_train_utils.distributed_utils import DistContext, all_reduce_sum, broadcast_object, gather_objects
from multi_train_utils.loaders import RunData
from multi_train_utils.train_eval_utils import Evaluation, Outputs, placed, validation_metrics, validation_outputs
from outputs.plotter import Plotter
from outputs.run_folder import BEST
from utils import REPORT_FILE, DataSplit, write_json

MAX_MISTAKES = 16


def top_ks(num_classes: int) -> list[int]:
    """Top-1, and top-3 and top-5 where there are more classes than that (top-5 of five is 100%)."""
    return [k for k in (1, 3, 5) if k == 1 or k < num_classes]


def evaluation_report(predictions: Iterable[tuple[torch.Tensor, torch.Tensor, list[int]]], ctx: DistContext,
                      split: DataSplit, source: str) -> dict[str, Any]:
    """The report over this rank's (logits, labels, validation indices) batches, reduced over ranks."""
    names = split.class_names
    n = len(names)
    ks = top_ks(n)
    counts = torch.zeros(n * n + len(ks), dtype=torch.int64, device=ctx.device)  # confusion, then top-k hits
    mistakes: list[tuple[float, int, int, int]] = []  # (probability, index, true, predicted)
    for logits, labels, indices in predictions:
        probs = logits.float().softmax(1)
        predicted = probs.argmax(1)
        counts[: n * n].index_add_(0, labels * n + predicted, torch.ones_like(labels))
        ranked = probs.topk(max(ks), dim=1).indices
        for i, k in enumerate(ks):
            counts[n * n + i] += (ranked[:, :k] == labels[:, None]).any(1).sum()
        wrong = (predicted != labels).nonzero().flatten().tolist()
        chosen = probs.max(1).values.tolist()
        mistakes += [(chosen[i], indices[i], int(labels[i]), int(predicted[i])) for i in wrong]
    counts = all_reduce_sum(counts, ctx).tolist()
    confusion = [counts[row * n : (row + 1) * n] for row in range(n)]
    mine = sorted(mistakes, key=lambda m: (-m[0], m[1]))[:MAX_MISTAKES]
    worst = sorted((m for part in gather_objects(mine, ctx) for m in part), key=lambda m: (-m[0], m[1]))[:MAX_MISTAKES]
    total = sum(map(sum, confusion))
    return {
        "weights": source,
        "images": total,
        "accuracy": sum(confusion[i][i] for i in range(n)) / total,
        **class_metrics(confusion, names),
        "top_k_accuracy": {str(k): hits / total for k, hits in zip(ks, counts[n * n :])},
        "class_names": names,
        "confusion_matrix": confusion,  # rows: true class, columns: predicted class
        "mistakes": [{"path": split.val[index][0], "true": names[true], "predicted": names[pred], "probability": p}
                     for p, index, true, pred in worst],
        "world_size": ctx.world_size,
    }


def class_metrics(confusion: list[list[int]], names: list[str]) -> dict[str, Any]:
    """Precision, recall, F1 and support per class, and the macro F1; 0 where a ratio has no
    denominator (a class never predicted, or absent)."""
    per_class = {}
    for i, name in enumerate(names):
        hits = confusion[i][i]
        predicted = sum(row[i] for row in confusion)
        support = sum(confusion[i])
        precision = hits / predicted if predicted else 0.0
        recall = hits / support if support else 0.0
        f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
        per_class[name] = {"precision": precision, "recall": recall, "f1": f1, "support": support}
    return {"macro_f1": sum(c["f1"] for c in per_class.values()) / len(names), "per_class": per_class}


def write_report_files(output_dir: Path, report: dict[str, Any]) -> None:
    write_json(output_dir / REPORT_FILE, report)
    with open(output_dir / "confusion_matrix.csv", "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["true \\ predicted", *report["class_names"]])
        for name, row in zip(report["class_names"], report["confusion_matrix"]):
            out.writerow([name, *row])


def report_line(report: dict[str, Any]) -> str:
    top = ", ".join(f"top-{k} {v:.4f}" for k, v in report["top_k_accuracy"].items())
    return (f"report on {report['weights']}: {report['images']} images, accuracy {report['accuracy']:.4f}, "
            f"macro F1 {report['macro_f1']:.4f}, {top}")


def report_on_best(model: nn.Module, val_loader: DataLoader, data: RunData, output_dir: Path, args: argparse.Namespace,
                   ctx: DistContext, best: tuple[int, Evaluation] | None) -> None:
    """At the end of a run: report.json and confusion_matrix.csv for best.pth's weights, from
    the outputs its epoch's evaluation kept on each rank (`best`: that epoch and its
    Evaluation; no second pass). When that epoch ran before a resume (`best` is None), best.pth
    is loaded into `model`, after a broadcast of whether rank 0 sees it (rank 0 may still be
    writing it), and evaluated again. Collectives: an all_reduce of the counts and an all_gather
    of the mistakes (and, when it reloads, that broadcast)."""
    if best is not None:
        epoch, evaluated = best
        source = best_source(output_dir / BEST, epoch, evaluated.better)
        final_report(evaluated.outputs, data.split, source, output_dir, ctx)  # all_reduce, all_gather
        return
    source = use_best_weights(output_dir, model, ctx)  # broadcast: whether rank 0 sees best.pth
    outputs = validation_outputs(placed(model, args, ctx.device), val_loader)
    final_report(outputs, data.split, source, output_dir, ctx)  # all_reduce, all_gather


def best_source(path: Path, epoch: int, better: str) -> str:
    return f"{path} (epoch {epoch}{' weight average' if better == 'ema' else ''})"


def use_best_weights(output_dir: Path, model: nn.Module, ctx: DistContext) -> str:
    """Load best.pth's weights into `model` on every rank (the model a user ships); say which."""
    best = output_dir / BEST
    # broadcast (it waits for rank 0, which may still be writing the file): rank 0's view decides
    # for every rank, which then all load the same weights (or none), whatever their own disk shows.
    if not broadcast_object(best.is_file() if ctx.is_main else None, ctx):
        return "the final weights"
    checkpoint = load_checkpoint(best, mmap=True)
    model.load_state_dict(shipped_weights(checkpoint))
    return best_source(best, checkpoint["epoch"], checkpoint.get("better", "model"))


def final_report(outputs: Outputs, split: DataSplit, source: str, output_dir: Path, ctx: DistContext) -> None:
    """report.json and confusion_matrix.csv for the weights that gave `outputs`, which came from `source`."""
    report = evaluation_report(outputs, ctx, split, source)
    ctx.print0(report_line(report))
    if ctx.is_main:
        write_report_files(output_dir, report)


def evaluate_only(model: nn.Module, checkpoint: dict[str, Any] | None, val_loader: DataLoader, data: RunData,
                  output_dir: Path, args: argparse.Namespace, ctx: DistContext) -> None:
    """--eval-only, the whole of it: `model` with the weights a checkpoint ships (--resume), or
    --weights, evaluated in one pass over the validation set: eval.json and the report (and
    its pictures). With
    --bn-recalibrate the statistics are recomputed first (a checkpoint of a run that did so
    holds them already: the same ones come out). Collectives: an all_reduce of the sums, then
    the report's."""
    source = args.weights
    if checkpoint is not None:
        model.load_state_dict(shipped_weights(checkpoint))
        source = checkpoint["loaded_from"]
    feed = placed(model, args, ctx.device)
    if data.recalibrate:
        feed = data.recalibrate(feed, ctx)  # broadcast: rank 0's recomputed statistics
    outputs = validation_outputs(feed, val_loader)
    result = validation_metrics(outputs, ctx)  # all_reduce
    ctx.print0(f"eval {source}: acc {result['val_acc']:.4f} ({result['val_correct']}/{result['val_total']}), "
               f"loss {result['val_loss']:.4f}")
    if ctx.is_main:
        write_json(output_dir / "eval.json", {**result, "weights": source, "world_size": ctx.world_size})
    final_report(outputs, data.split, source, output_dir, ctx)  # all_reduce, all_gather
    if ctx.is_main and args.plots:
        with Plotter(output_dir) as plotter:
            plotter.draw_report()
