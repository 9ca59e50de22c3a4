"""The torchvision model (ResNet34 unless asked otherwise) and its classifier head, freezing
its backbone, and BatchNorm that syncs on the CPU."""
from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.distributed as dist
import torchvision
from torch import nn

from utils import UserError

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
    """A torchvision classification model by name, randomly initialised, with `num_classes` outputs;
    each ResNet block's last BatchNorm at zero (`zero_init_residual`); BlurConv2d (`blurpool`)."""
    extra = {"zero_init_residual": True} if zero_init_residual else {}
    model = torchvision.models.get_model(name, weights=None, num_classes=num_classes, **extra)
    if blurpool and not blur_strided_convolutions(model):
        raise UserError("--blurpool blurs strided convolutions of 16 input channels or more, "
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


def blur_strided_convolutions(model: nn.Module, min_channels: int = 16) -> int:
    """Make every strided convolution of `model` (with 16 input channels or more) a BlurConv2d
    with the same weights, and say how many there were. In ResNet34: the first convolution of
    the first block of layers 2 to 4 and its shortcut's. Composer leaves out convolutions of fewer
    input channels: the stem, on the 3 colour channels, must see the full-resolution picture. The
    max-pooling after the stem stays: its blurred form pools at stride 1, four times the work at the
    network's largest feature map."""
    blurred_count = 0
    for parent in list(model.modules()):
        for name, conv in list(parent.named_children()):
            if type(conv) is nn.Conv2d and conv.stride != (1, 1) and conv.in_channels >= min_channels:
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
