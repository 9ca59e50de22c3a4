"""Export a trained checkpoint as a model to ship, and check the export against PyTorch.

    python export.py --checkpoint runs/single-20240101-120000/best.pth                  # model.onnx
    python export.py --checkpoint best.pth --format export --output flowers.pt2         # torch.export
    python export.py --checkpoint best.pth --format torchscript                         # deprecated in PyTorch

The model takes normalised float32 images (batch, 3, S, S), any batch size, and gives logits.
Beside it, MODEL.json records what a user must feed it: image size, resize and crop, mean and
std, class names. The export then checks itself: the exported model and the PyTorch model
classify real photos (batches of several images and of one), and their logits must agree to
within TOLERANCE x (1 + |logit|); otherwise nothing is kept and the exit code is 1. ONNX needs
`pip install -r requirements-export.txt`; training does not.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from outputs.exported import EXPORT_FORMATS, describe_export, export_model, load_exported, preprocessing_path
from multi_train_utils.checkpoint import architecture, load_checkpoint, model_from_checkpoint
from my_dataset import ImageFiles, eval_img_size, normalize
from utils import ProjectError, UserError, exit_on_error, image_files, write_json

BUNDLED_PHOTOS = Path(__file__).resolve().parent / "data" / "flower_photos_sample"
CHECK_IMAGES = 16


class ExportMismatch(ProjectError):
    """The exported model computes something else than the PyTorch model: exit code 1."""


def check_batch(folder: Path, img_size: int) -> torch.Tensor:
    """Up to CHECK_IMAGES real photos from `folder`, spread over it, as the model takes them."""
    paths = image_files(folder)
    if not paths:
        raise UserError(f"no image found in {str(folder)!r} to check the export with")
    picked = paths[:: max(1, len(paths) // CHECK_IMAGES)][:CHECK_IMAGES]
    dataset = ImageFiles(picked, img_size)
    images, errors = zip(*(dataset[i] for i in range(len(dataset))))
    if any(errors):
        raise UserError(f"cannot read the check images: {next(e for e in errors if e)}")
    return normalize(torch.stack(images))


def largest_difference(model: torch.nn.Module, exported, images: torch.Tensor) -> float:
    """max |exported - PyTorch| / (1 + |PyTorch|) over the logits, for the whole batch and for
    one image alone (the batch dimension is dynamic: both must work)."""
    worst = 0.0
    with torch.inference_mode():
        for batch in (images, images[:1]):
            expected = model(batch)
            got = exported(batch)
            if tuple(got.shape) != tuple(expected.shape):
                raise ExportMismatch(f"the exported model gave logits of shape {tuple(got.shape)}, "
                                     f"PyTorch {tuple(expected.shape)}")
            worst = max(worst, ((got - expected).abs() / (1 + expected.abs())).max().item())
    return worst


@exit_on_error
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True, metavar="PATH", help="best.pth or last.pth of a training run")
    parser.add_argument("--format", default="onnx", choices=list(EXPORT_FORMATS),
                        help="onnx (default), export (torch.export, .pt2) or torchscript (deprecated in PyTorch)")
    parser.add_argument("--output", default=None, metavar="PATH",
                        help="the model file (default: model.onnx, model.pt2 or model.torchscript.pt beside "
                             "the checkpoint); its description goes to PATH.json")
    parser.add_argument("--check-images", default=None, type=Path, metavar="FOLDER",
                        help="photos to compare the exported model with PyTorch on (default: the bundled sample)")
    parser.add_argument("--tolerance", type=float, default=1e-3,
                        help="largest |logit difference| / (1 + |logit|) accepted (default: 1e-3)")
    args = parser.parse_args()
    checkpoint = load_checkpoint(args.checkpoint, mmap=True)
    model = model_from_checkpoint(checkpoint)
    img_size = eval_img_size(checkpoint["args"])
    output = Path(args.output or Path(args.checkpoint).with_name("model" + EXPORT_FORMATS[args.format]))
    images = check_batch(args.check_images or BUNDLED_PHOTOS, img_size)
    export_model(model, args.format, output, img_size)
    description = describe_export(args.format, architecture(checkpoint), checkpoint["class_names"], img_size)
    try:
        worst = largest_difference(model, load_exported(output, args.format), images)
        if not worst <= args.tolerance:  # also catches NaN
            raise ExportMismatch(f"the exported model's logits differ from PyTorch's by up to {worst:.2e} "
                                 f"(relative to 1 + |logit|), more than --tolerance {args.tolerance:g}; "
                                 "nothing was kept")
    except BaseException:
        output.unlink(missing_ok=True)
        raise
    write_json(preprocessing_path(output), {
        **description, "checkpoint": str(args.checkpoint), "epoch": checkpoint["epoch"], "torch": torch.__version__,
        "check": {"images": len(images), "largest_relative_difference": worst, "tolerance": args.tolerance},
    })
    print(f"wrote {output} and {preprocessing_path(output)}: {args.format}, {len(description['class_names'])} "
          f"classes, {img_size} px; on {len(images)} photos its logits agree with PyTorch's to {worst:.1e}")


if __name__ == "__main__":
    main()
