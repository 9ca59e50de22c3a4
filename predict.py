"""Classify images with a trained checkpoint or an exported ONNX model: the top-k classes and
their probabilities.

    python predict.py --checkpoint runs/single-20240101-120000/best.pth photo.jpg more_photos/
    python predict.py --checkpoint best.pth data/flower_photos_sample --top-k 1 --json > predictions.jsonl
    python predict.py --checkpoint runs/single-20240101-120000/model.onnx photo.jpg   # after export.py

Folders are searched recursively. The class names and the image size come from the checkpoint
(or the JSON that export.py writes beside the model); images get the validation transform. Exit code 1 when some file could not be read (each is
named on stderr, the others are still predicted), 2 for a bad checkpoint or no image at all.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from outputs.exported import EXPORT_FORMATS, load_exported, read_preprocessing
from multi_train_utils.checkpoint import load_checkpoint, model_from_checkpoint
from multi_train_utils.distributed_utils import resolve_device
from multi_train_utils.train_eval_utils import model_input
from my_dataset import ImageFiles, default_workers, eval_img_size, normalize
from utils import IMG_EXTENSIONS, UserError, cpu_count, exit_on_error, image_files


def find_images(inputs: list[str]) -> tuple[list[str], list[tuple[str, str]]]:
    """Image files named or found below the inputs (by training's own rule), and (path, reason)
    for inputs that do not exist. A file named explicitly is taken whatever its extension: the
    user asked."""
    files: list[str] = []
    missing: list[tuple[str, str]] = []
    for item in inputs:
        if os.path.isfile(item):
            files.append(item)
        elif os.path.isdir(item):
            files.extend(image_files(item))
        else:
            missing.append((item, "no such file or directory"))
    return list(dict.fromkeys(files)), missing  # a file named twice is predicted once


@dataclasses.dataclass(frozen=True)
class Classifier:
    """What predicting needs of a model: its classes, its input size, and the logits of a
    uint8 batch (a checkpoint's model on `device`, or an exported ONNX model on the CPU)."""

    class_names: list[str]
    img_size: int
    logits: Callable[[torch.Tensor], torch.Tensor]
    device: torch.device


def load_classifier(path: str, device: torch.device) -> Classifier:
    if path.endswith(EXPORT_FORMATS["onnx"]):
        info = read_preprocessing(Path(path))
        run = load_exported(Path(path), "onnx")
        return Classifier(info["class_names"], info["img_size"], lambda images: run(normalize(images)),
                          torch.device("cpu"))
    checkpoint = load_checkpoint(path, mmap=True)  # mapped: the optimizer state is never read
    # Evaluated as the run evaluated it: at its validation size, with its --tta.
    model, tta = model_from_checkpoint(checkpoint).to(device), checkpoint["args"].get("tta", False)

    def logits(images: torch.Tensor) -> torch.Tensor:
        inputs = model_input(images, device, channels_last=False)
        return (model(inputs) + model(inputs.flip(3))) / 2 if tta else model(inputs)

    return Classifier(checkpoint["class_names"], eval_img_size(checkpoint["args"]), logits, device)


def predict(
    classifier: Classifier, paths: list[str], top_k: int, batch_size: int, workers: int
) -> Iterator[tuple[str, list[tuple[str, float]] | None, str]]:
    """(path, [(class, probability), ...] best first, "") per image, or (path, None, reason)."""
    class_names = classifier.class_names
    loader = DataLoader(ImageFiles(paths, classifier.img_size), batch_size=batch_size, num_workers=workers,
                        pin_memory=classifier.device.type == "cuda")
    top_k = min(top_k, len(class_names))
    done = 0
    with torch.inference_mode():
        for images, errors in loader:
            probs = classifier.logits(images).float().softmax(1)
            values, indices = probs.topk(top_k, dim=1)
            for path, error, row_values, row_indices in zip(
                paths[done : done + len(errors)], errors, values.tolist(), indices.tolist()
            ):
                if error:
                    yield path, None, error
                else:
                    yield path, [(class_names[i], p) for i, p in zip(row_indices, row_values)], ""
            done += len(errors)


@exit_on_error
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])  # the first paragraph, whole
    parser.add_argument("inputs", nargs="+", metavar="IMAGE_OR_FOLDER", help="image files and folders of images")
    parser.add_argument("--checkpoint", required=True, metavar="PATH",
                        help="best.pth or last.pth of a training run, or a model.onnx written by export.py")
    parser.add_argument("--top-k", type=int, default=3, metavar="K", help="classes shown per image (default: 3)")
    parser.add_argument("--json", action="store_true", help="one JSON object per line instead of a table")
    parser.add_argument("--batch-size", type=int, default=32, metavar="N", help="images per forward pass (default: 32)")
    parser.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when present, else cpu)")
    parser.add_argument("--workers", type=int, default=None, metavar="N",
                        help="image-decoding processes (default: CPUs - 1, at most 8 on the CPU)")
    args = parser.parse_args()
    if args.top_k < 1 or args.batch_size < 1 or (args.workers or 0) < 0:
        raise UserError("--top-k and --batch-size must be at least 1, --workers at least 0")
    device = resolve_device(args.device, 0)
    classifier = load_classifier(args.checkpoint, device)
    paths, failed = find_images(args.inputs)
    for path, reason in failed:
        print(f"warning: cannot read {path}: {reason}", file=sys.stderr, flush=True)
    if not paths:
        raise UserError(f"no image found in {', '.join(args.inputs)} (looked for {' '.join(IMG_EXTENSIONS)} files)")
    workers = default_workers(device, cpu_count()) if args.workers is None else args.workers
    path_width = max(len(p) for p in paths)
    class_width = max(len(c) for c in classifier.class_names)
    try:
        for path, top, error in predict(classifier, paths, args.top_k, args.batch_size, workers):
            if top is None:
                failed.append((path, error))
                print(f"warning: cannot read {path}: {error}", file=sys.stderr, flush=True)
            elif args.json:
                print(json.dumps({"path": path, "top": [{"class": c, "prob": round(p, 6)} for c, p in top]}),
                      flush=True)
            else:
                print(f"{path:<{path_width}}  " + "  ".join(f"{c:<{class_width}} {p:.3f}" for c, p in top),
                      flush=True)
    except BrokenPipeError:
        # The reader (head, less) stopped early: end quietly, as other command-line tools do.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
