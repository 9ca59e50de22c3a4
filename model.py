"""The torchvision model (ResNet34 unless asked otherwise) and its classifier head, freezing
its backbone, BatchNorm that syncs on the CPU, and the formats a trained model ships in (ONNX,
torch.export, TorchScript)."""
from __future__ import annotations

import argparse
import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torchvision
from torch import nn

from my_dataset import IMAGENET_MEAN, IMAGENET_STD, eval_resize
from utils import UserError

# format -> file ending. The exported model takes normalised float32 images (N, 3, H, W) with
# any N, and gives logits (N, classes).
EXPORT_FORMATS = {"onnx": ".onnx", "export": ".pt2", "torchscript": ".torchscript.pt"}
INPUT_NAME, OUTPUT_NAME = "images", "logits"
ONNX_PACKAGES = "onnx, onnxscript and onnxruntime (pip install -r requirements-export.txt)"


DEFAULT_MODEL = "resnet34"
# The torchvision models built by its ResNet class, which takes zero_init_residual.
RESIDUAL_MODELS = ("resnet", "resnext", "wide_resnet")


def model_names() -> list[str]:
    """torchvision's image classification models (not its detection or segmentation ones)."""
    return torchvision.models.list_models(module=torchvision.models)


def check_model_name(name: str, zero_init_residual: bool = False) -> None:
    if name not in model_names():
        raise UserError(f"--model {name!r} is not a torchvision classification model; "
                        f"these are: {', '.join(model_names())}")
    if zero_init_residual and not name.startswith(RESIDUAL_MODELS):
        raise UserError(f"--zero-init-residual is for torchvision's ResNets ({', '.join(RESIDUAL_MODELS)}...), "
                        f"not {name}")


def create_model(num_classes: int, name: str = DEFAULT_MODEL, zero_init_residual: bool = False,
                 blurpool: bool = False) -> nn.Module:
    """A torchvision classification model by name, randomly initialised, with `num_classes` outputs.
    `zero_init_residual` (ResNets): each residual block's last BatchNorm starts at zero, so every
    block starts as the identity and the network as a shallow one (Goyal et al., 2017).
    `blurpool`: its strided convolutions blur their input first (`BlurConv2d`)."""
    check_model_name(name, zero_init_residual)
    extra = {"zero_init_residual": True} if zero_init_residual else {}
    model = torchvision.models.get_model(name, weights=None, num_classes=num_classes, **extra)
    if blurpool and not blur_strided_convolutions(model):
        raise UserError(f"--blurpool blurs strided convolutions of {BLUR_MIN_CHANNELS} input channels or more, "
                        f"and {name} has none")
    return model


def model_for(args: argparse.Namespace, num_classes: int) -> nn.Module:
    """The model the command line asks for: --model, --zero-init-residual, --blurpool."""
    return create_model(num_classes, args.model, args.zero_init_residual, args.blurpool)


class BlurConv2d(nn.Conv2d):
    """A strided convolution that low-pass filters its input first, so that downsampling does
    not alias (BlurPool: Zhang, "Making Convolutional Networks Shift-Invariant Again", 2019).
    This is the cheap form MosaicML's Composer uses: a 3x3 binomial blur at stride 1, then the
    convolution with its own stride. Zhang's form, the convolution at stride 1 then a strided
    blur, does four times that convolution's arithmetic. The blur is a fixed buffer left out of
    the state dict: the weights are the plain convolution's, and load either way."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        row = torch.tensor([1.0, 2.0, 1.0])
        kernel = (row[:, None] * row[None, :]) / 16  # sums to 1: a flat image stays flat
        self.register_buffer("blur", kernel.expand(self.in_channels, 1, 3, 3).clone(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Zero padding, as the convolution itself pads; one filter per channel (groups).
        return super().forward(nn.functional.conv2d(x, self.blur.to(x.dtype), padding=1, groups=self.in_channels))


# Composer leaves out convolutions of fewer input channels: the stem, on the 3 colour channels,
# which must see the full-resolution picture as it is.
BLUR_MIN_CHANNELS = 16


def blur_strided_convolutions(model: nn.Module) -> int:
    """Make every strided convolution of `model` (with 16 input channels or more) a BlurConv2d
    with the same weights, and say how many there were. In ResNet34: the first convolution of
    the first block of layers 2 to 4 and its shortcut's. The max-pooling after the stem stays: its blurred form
    pools at stride 1, four times the work at the network's largest feature map."""
    blurred_count = 0
    for parent in list(model.modules()):
        for name, conv in list(parent.named_children()):
            if type(conv) is nn.Conv2d and conv.stride != (1, 1) and conv.in_channels >= BLUR_MIN_CHANNELS:
                blurred = BlurConv2d(conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride, conv.padding,
                                     conv.dilation, conv.groups, conv.bias is not None, conv.padding_mode)
                blurred.load_state_dict(conv.state_dict())
                setattr(parent, name, blurred)
                blurred_count += 1
    return blurred_count


def imagenet_state_dict(name: str) -> dict[str, torch.Tensor]:
    """The default ImageNet weights torchvision has for model `name` (downloaded once, then cached)."""
    return torchvision.models.get_model_weights(name).DEFAULT.get_state_dict(progress=True)


def classifier(model: nn.Module) -> tuple[str, nn.Linear]:
    """The classification head: the model's last Linear layer (`fc` in a ResNet)."""
    heads = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    if not heads:
        raise UserError(f"{type(model).__name__} has no Linear layer for a classifier head")
    return heads[-1]


def freeze_backbone(model: nn.Module) -> None:
    """Train only the classifier head."""
    head = classifier(model)[0] + "."
    for name, param in model.named_parameters():
        param.requires_grad_(name.startswith(head))


def set_train_mode(model: nn.Module) -> None:
    """model.train(), except BatchNorm layers whose parameters are frozen stay in eval mode:
    a frozen backbone must not have its running statistics drift towards the new data."""
    model.train()
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.weight is not None:
            if not module.weight.requires_grad:
                module.eval()


class _AllReduceSum(torch.autograd.Function):
    """Sum over ranks, differentiably: the gradient of a sum over ranks is the sum over
    ranks of the incoming gradients."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        tensor = tensor.clone()
        dist.all_reduce(tensor)
        return tensor

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


class CPUSyncBatchNorm(nn.BatchNorm2d):
    """BatchNorm2d whose batch statistics are taken over every rank, for CPU (gloo) jobs.

    torch.nn.SyncBatchNorm only runs on accelerators. This computes the same thing with a
    differentiable all_reduce: the forward pass sums (count, sum) and then the squared
    deviations over ranks, and the backward pass sums the matching gradients, so N ranks with
    batch b compute what one process with batch N*b would. The statistics are taken in fp32 at
    least, whatever autocast hands in (bf16 sums drift, and the running buffers are fp32); the
    output goes back in the input's dtype.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.training and dist.is_available() and dist.is_initialized()):
            return super().forward(x)
        in_dtype, x = x.dtype, x.to(torch.promote_types(x.dtype, torch.float32))
        channels = x.shape[1]
        dims = [0, 2, 3]
        local = torch.cat([x.sum(dims), x.new_tensor([x.numel() / channels])])
        total = _AllReduceSum.apply(local)
        count = total[-1]
        mean = total[:channels] / count
        centered = x - mean.view(1, -1, 1, 1)
        var = _AllReduceSum.apply(centered.pow(2).sum(dims)) / count
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                momentum = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
                unbiased = var * (count / (count - 1).clamp(min=1))
                self.running_mean.lerp_(mean, momentum)
                self.running_var.lerp_(unbiased, momentum)
        out = centered * torch.rsqrt(var + self.eps).view(1, -1, 1, 1)
        if self.affine:
            out = out * self.weight.view(1, -1, 1, 1) + self.bias.view(1, -1, 1, 1)
        return out.to(in_dtype)


def cpu_sync_batchnorm(model: nn.Module) -> nn.Module:
    """`model` with each BatchNorm2d swapped for a CPUSyncBatchNorm of the same state: what
    torch.nn.SyncBatchNorm.convert_sync_batchnorm does for GPUs, for a CPU (gloo) job."""
    for name, child in model.named_children():
        if type(child) is nn.BatchNorm2d:
            sync = CPUSyncBatchNorm(child.num_features, child.eps, child.momentum, child.affine, child.track_running_stats)
            sync.load_state_dict(child.state_dict())
            sync.train(child.training)
            if child.affine:
                sync.weight.requires_grad_(child.weight.requires_grad)
                sync.bias.requires_grad_(child.bias.requires_grad)
            setattr(model, name, sync)
        else:
            cpu_sync_batchnorm(child)
    return model


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


def unwrapped(model: nn.Module) -> nn.Module:
    """The model inside DistributedDataParallel's and torch.compile's wrappers (`_orig_mod`: the
    compiled module's own name for it; looked up, so that torch's compiler is not imported)."""
    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):
            model = model._orig_mod
        else:
            return model


def batch_norms(module: nn.Module) -> list[nn.modules.batchnorm._BatchNorm]:
    return [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def batch_norm_statistics(module: nn.Module) -> dict[str, torch.Tensor]:
    """The BatchNorm buffers of `module` (running mean, variance and batch count), by state-dict key."""
    names = {id(m): name for name, m in module.named_modules()}
    return {f"{names[id(m)]}.{key}".lstrip("."): value.detach().clone()
            for m in batch_norms(module) for key, value in m.named_buffers(recurse=False)}
