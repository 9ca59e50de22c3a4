"""The evaluation report: per-class precision, recall and F1, top-k accuracy, the confusion
matrix and the most confidently wrong images, exact at any world size; made at the end of a run
for best.pth's weights (--report), and by --eval-only. And the run's pictures (--plots).

Each rank counts its shard of the validation split; the counts are all-reduced once, and the
few mistakes each rank keeps are gathered once. report.json holds everything, so plots.py can
redraw the pictures from a finished run; confusion_matrix.csv is the matrix for spreadsheets.
"""
from __future__ import annotations

import argparse
import csv
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from multi_train_utils.checkpoint import BEST, load_checkpoint, shipped_weights
from multi_train_utils.distributed_utils import DistContext, all_reduce_sum, barrier, gather_objects
from multi_train_utils.train_eval_utils import Extras, evaluate, model_input
from recipe.recalibrate import recalibration
from utils import REPORT_FILE, DataSplit, UserError, stderr_line, write_json


def top_ks(num_classes: int) -> list[int]:
    """Top-1, and top-3 and top-5 where there are more classes than that (top-5 of five is 100%)."""
    return [k for k in (1, 3, 5) if k == 1 or k < num_classes]


@torch.no_grad()
def predictions(model: nn.Module, loader: Iterable, args: argparse.Namespace,
                ctx: DistContext) -> Iterator[tuple[torch.Tensor, torch.Tensor, list[int]]]:
    """(logits, labels, dataset indices) of each batch of this rank's shard, the model in eval
    mode and in fp32."""
    model.eval()
    indices = iter(loader.sampler)  # the order the loader draws its batches in
    for images, labels in loader:
        inputs = model_input(images, ctx.device, args.channels_last)
        logits = model(inputs)
        if args.tta:
            logits = (logits + model(inputs.flip(3))) / 2
        yield logits, labels.to(ctx.device), [next(indices) for _ in range(len(labels))]


def evaluation_report(outputs: Iterable[tuple[torch.Tensor, torch.Tensor, list[int]]], ctx: DistContext,
                      split: DataSplit, source: str, most_mistakes: int = 16) -> dict[str, Any]:
    """The report over this rank's (logits, labels, validation indices) batches, reduced over
    ranks. Collectives: an all_reduce of the counts, an all_gather of each rank's worst mistakes."""
    names = split.class_names
    n = len(names)
    ks = top_ks(n)
    counts = torch.zeros(n * n + len(ks), dtype=torch.int64, device=ctx.device)  # confusion, then top-k hits
    mistakes: list[tuple[float, int, int, int]] = []  # (probability, index, true, predicted)
    for logits, labels, indices in outputs:
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
    mine = sorted(mistakes, key=lambda m: (-m[0], m[1]))[:most_mistakes]
    worst = sorted((m for part in gather_objects(mine, ctx) for m in part), key=lambda m: (-m[0], m[1]))[:most_mistakes]
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


def final_report(model: nn.Module, loader: Iterable, split: DataSplit, source: str, output_dir: Path,
                 args: argparse.Namespace, ctx: DistContext) -> None:
    """report.json and confusion_matrix.csv for `model`'s weights, which came from `source`."""
    report = evaluation_report(predictions(model, loader, args, ctx), ctx, split, source)  # all_reduce, all_gather
    ctx.print0(report_line(report))
    if ctx.is_main:
        write_report_files(output_dir, report)


def report_on_best(model: nn.Module, loader: Iterable, split: DataSplit, output_dir: Path, args: argparse.Namespace,
                   ctx: DistContext) -> None:
    """--report, at the end of a run: best.pth's weights (the ones a user ships) loaded into
    `model` on every rank and evaluated once more, per class. Collectives: a barrier (best.pth is
    on disk before any rank reads it), an all_gather of what each rank read, or why it could not
    (a rank that raised alone would leave the others waiting), then the report's."""
    barrier(ctx)
    best, problem = output_dir / BEST, None
    try:
        checkpoint = load_checkpoint(best, mmap=True)
        model.load_state_dict(shipped_weights(checkpoint))
    except UserError as e:
        problem = str(e)
    if failed := [(rank, why) for rank, why in enumerate(gather_objects(problem, ctx)) if why]:
        raise UserError(f"rank {failed[0][0]}: {failed[0][1]}" if ctx.distributed else failed[0][1])
    source = f"{best} (epoch {checkpoint['epoch']}{' weight average' if checkpoint.get('better') == 'ema' else ''})"
    final_report(model, loader, split, source, output_dir, args, ctx)


def evaluate_only(model: nn.Module, checkpoint: dict[str, Any] | None, loader: Iterable, split: DataSplit,
                  output_dir: Path, args: argparse.Namespace, ctx: DistContext) -> None:
    """--eval-only, the whole of it: `model` with the weights a checkpoint ships (--resume), or
    --weights, evaluated: eval.json, the report (and with --plots its pictures). With
    --bn-recalibrate the statistics are recomputed first (a checkpoint of a run that did so holds
    them already: the same ones come out). Collectives: evaluate's, then the report's."""
    extra = Extras(recalibrate=recalibration(split, args))
    source = args.weights
    if checkpoint is not None:
        model.load_state_dict(shipped_weights(checkpoint))
        source = checkpoint["loaded_from"]
    result = evaluate(model, loader, args, ctx, extra).val
    ctx.print0(f"eval {source}: acc {result['val_acc']:.4f} ({result['val_correct']}/{result['val_total']}), "
               f"loss {result['val_loss']:.4f}")
    if ctx.is_main:
        write_json(output_dir / "eval.json", {**result, "weights": source, "world_size": ctx.world_size})
    if extra.recalibrate:  # the report of the weights just evaluated, their statistics recomputed
        model = extra.recalibrate(model, ctx)
    final_report(model, loader, split, source, output_dir, args, ctx)
    if ctx.is_main and args.plots:
        draw_plots(output_dir)


def draw_plots(output_dir: Path) -> None:
    """Rank 0, at the end: the run's PNGs (plots.py). A picture never fails the run: a failure is
    one warning line."""
    from plots import save_run_plots  # matplotlib's import and drawing take seconds: only when asked

    save_run_plots(output_dir, log=stderr_line)
