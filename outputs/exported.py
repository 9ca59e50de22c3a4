"""The formats a trained model ships in: ONNX, torch.export and TorchScript, each with a JSON
description beside it of what to feed it (export.py writes them, predict.py reads them back)."""
from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from my_dataset import IMAGENET_MEAN, IMAGENET_STD, eval_resize
from utils import UserError

# format -> file ending. The exported model takes normalised float32 images (N, 3, H, W) with
# any N, and gives logits (N, classes).
EXPORT_FORMATS = {"onnx": ".onnx", "export": ".pt2", "torchscript": ".torchscript.pt"}
INPUT_NAME, OUTPUT_NAME = "images", "logits"
ONNX_PACKAGES = "onnx, onnxscript and onnxruntime (pip install -r requirements-export.txt)"


def export_model(model: nn.Module, fmt: str, path: Path, img_size: int) -> None:
    """Write `model` (in eval mode, on the CPU) in `fmt`, with a dynamic batch dimension."""
    example = torch.randn(2, 3, img_size, img_size)
    dynamic = {"x": {0: torch.export.Dim("batch", min=1)}}  # "x": the forward's argument
    if fmt == "onnx":
        try:
            torch.onnx.export(model, (example,), str(path), input_names=[INPUT_NAME], output_names=[OUTPUT_NAME],
                              dynamic_shapes=dynamic, dynamo=True, external_data=False, verbose=False)
        except ImportError as e:
            raise UserError(f"export to ONNX needs {ONNX_PACKAGES}: {e}") from None
    elif fmt == "export":
        torch.export.save(torch.export.export(model, (example,), dynamic_shapes=dynamic), path)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # deprecated, and said so in export.py's help
            torch.jit.trace(model, example).save(str(path))


def load_exported(path: Path, fmt: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The exported model as a function from a normalised float32 CPU batch to its logits."""
    if fmt == "onnx":
        try:
            import onnxruntime
        except ImportError as e:
            raise UserError(f"running an ONNX model needs {ONNX_PACKAGES}: {e}") from None
        session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        return lambda images: torch.from_numpy(session.run([OUTPUT_NAME], {INPUT_NAME: images.numpy()})[0])
    if fmt == "export":
        return torch.export.load(path).module()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return torch.jit.load(str(path))


def preprocessing_path(model_path: Path) -> Path:
    return Path(f"{model_path}.json")


def describe_export(fmt: str, architecture: str, class_names: list[str], img_size: int) -> dict[str, Any]:
    """What a user of the exported model needs to feed it: written beside it as JSON."""
    return {
        "format": fmt,
        "architecture": architecture,
        "class_names": class_names,
        "img_size": img_size,
        "input": {"name": INPUT_NAME, "shape": ["batch", 3, img_size, img_size], "dtype": "float32",
                  "layout": "NCHW", "channels": "RGB"},
        "output": {"name": OUTPUT_NAME, "shape": ["batch", len(class_names)], "meaning": "logits; softmax for probabilities"},
        "preprocessing": {"resize_short_side": eval_resize(img_size), "center_crop": img_size,
                          "scale": "pixels / 255", "mean": list(IMAGENET_MEAN), "std": list(IMAGENET_STD),
                          "formula": "(pixels / 255 - mean) / std, per channel"},
    }


def read_preprocessing(model_path: Path) -> dict[str, Any]:
    path = preprocessing_path(model_path)
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{str(model_path)!r} needs its description {str(path)!r}, written by export.py beside it: "
                        f"{type(e).__name__}: {e}") from None
