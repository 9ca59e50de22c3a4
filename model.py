"""ResNet34 from torchvision, freezing its backbone, and BatchNorm that syncs on the CPU."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torchvision.models import resnet34


def create_model(num_classes: int) -> nn.Module:
    return resnet34(weights=None, num_classes=num_classes)


def freeze_backbone(model: nn.Module) -> None:
    """Train only the classifier (`fc`)."""
    for name, param in model.named_parameters():
        param.requires_grad_(name.startswith("fc."))


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


def convert_sync_batchnorm(model: nn.Module, device: torch.device) -> nn.Module:
    if device.type != "cpu":
        return nn.SyncBatchNorm.convert_sync_batchnorm(model)
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
            convert_sync_batchnorm(child, device)
    return model
