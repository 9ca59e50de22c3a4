"""The evaluation report's arithmetic, on predictions whose right answers are known."""
from __future__ import annotations

import csv
import inspect

import pytest
import torch

from multi_train_utils.distributed_utils import DistContext
from outputs.report import class_metrics, evaluation_report, top_ks, write_report_files
from utils import DataSplit

NAMES = ["cat", "dog", "fox"]


def logits_for(predicted: list[int], confidence: list[float]) -> torch.Tensor:
    """Logits whose softmax puts `confidence` on the predicted class and splits the rest evenly."""
    rows = []
    for p, c in zip(predicted, confidence):
        probs = torch.full((3,), (1 - c) / 2)
        probs[p] = c
        rows.append(probs.log())
    return torch.stack(rows)


def test_class_metrics_by_hand():
    # rows: true class; columns: predicted. cat: 3 of 4 right; dog: 1 of 2; fox: never predicted.
    confusion = [[3, 1, 0], [1, 1, 0], [2, 0, 0]]
    metrics = class_metrics(confusion, NAMES)
    cat, dog, fox = (metrics["per_class"][n] for n in NAMES)
    assert cat == {"precision": 3 / 6, "recall": 3 / 4, "f1": pytest.approx(2 * 0.5 * 0.75 / 1.25), "support": 4}
    assert dog == {"precision": 1 / 2, "recall": 1 / 2, "f1": 0.5, "support": 2}
    assert fox == {"precision": 0.0, "recall": 0.0, "f1": 0.0, "support": 2}
    assert metrics["macro_f1"] == pytest.approx((0.6 + 0.5 + 0.0) / 3)


def test_top_k_only_where_it_says_something():
    assert top_ks(2) == [1] and top_ks(3) == [1] and top_ks(5) == [1, 3] and top_ks(6) == [1, 3, 5]


def test_report_from_known_predictions(tmp_path):
    val = [(f"img{i}.jpg", label) for i, label in enumerate([0, 0, 1, 1, 2, 2])]
    split = DataSplit(NAMES, train=[], val=val)
    labels = torch.tensor([label for _, label in val])
    # Two batches, as a loader would give them, with the dataset indices of their images.
    batches = [(logits_for([0, 1, 1], [0.9, 0.8, 0.6]), labels[:3], [0, 1, 2]),
               (logits_for([0, 2, 0], [0.5, 0.7, 0.95]), labels[3:], [3, 4, 5])]
    report = evaluation_report(batches, DistContext.single(), split, "weights.pth")
    assert report["confusion_matrix"] == [[1, 1, 0], [1, 1, 0], [1, 0, 1]]
    assert report["images"] == 6 and report["accuracy"] == 3 / 6
    assert report["top_k_accuracy"] == {"1": 0.5}
    # Wrong ones, most confident first: img5 (fox as cat, 0.95), img1 (cat as dog, 0.8), img3 (dog as cat, 0.5).
    assert [(m["path"], m["true"], m["predicted"]) for m in report["mistakes"]] == [
        ("img5.jpg", "fox", "cat"), ("img1.jpg", "cat", "dog"), ("img3.jpg", "dog", "cat")]
    assert report["mistakes"][0]["probability"] == pytest.approx(0.95)

    write_report_files(tmp_path, report)
    with open(tmp_path / "confusion_matrix.csv") as f:
        rows = list(csv.reader(f))
    assert rows == [["true \\ predicted", *NAMES], ["cat", "1", "1", "0"], ["dog", "1", "1", "0"], ["fox", "1", "0", "1"]]


def test_mistakes_are_capped():
    cap = inspect.signature(evaluation_report).parameters["most_mistakes"].default
    n = cap + 5
    split = DataSplit(NAMES, train=[], val=[(f"img{i}.jpg", 0) for i in range(n)])
    confidences = [0.4 + 0.5 * i / n for i in range(n)]
    outputs = [(logits_for([1] * n, confidences), torch.zeros(n, dtype=torch.long), list(range(n)))]
    report = evaluation_report(outputs, DistContext.single(), split, "w")
    assert len(report["mistakes"]) == cap == 16
    assert report["mistakes"][0]["path"] == f"img{n - 1}.jpg"  # the most confident first
    fewer = evaluation_report(outputs, DistContext.single(), split, "w", most_mistakes=3)
    assert [m["path"] for m in fewer["mistakes"]] == [f"img{i}.jpg" for i in (n - 1, n - 2, n - 3)]
