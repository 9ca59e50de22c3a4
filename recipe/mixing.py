"""--mixup-alpha and --cutmix-alpha: each batch mixed as torchvision.transforms.v2 mixes it."""
from __future__ import annotations

import argparse

import torch
from torch import nn
from torchvision.transforms import v2

from model import classifier


class BatchMix:
    """MixUp and/or CutMix (one of the two per batch when both are asked for, as torchvision's
    references do), each batch's draws from a generator seeded by the run's seed and the batch's
    number in the run: a resumed or repeated run mixes the same way."""

    def __init__(self, transform: v2.Transform, seed: int):
        self.transform, self.seed = transform, seed

    def __call__(self, images: torch.Tensor, labels: torch.Tensor, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch and its soft targets."""
        with torch.random.fork_rng(devices=[]):  # the draws happen on the CPU, whatever the device
            torch.manual_seed(self.seed * 1_000_003 + batch)
            return self.transform(images, labels)


def build_mix(args: argparse.Namespace, model: nn.Module) -> BatchMix | None:
    """The mixing `args` ask for, or None."""
    asked = [(mix, alpha) for mix, alpha in ((v2.MixUp, args.mixup_alpha), (v2.CutMix, args.cutmix_alpha)) if alpha > 0]
    if not asked:
        return None
    num_classes = classifier(model)[1].out_features
    mixes = [mix(alpha=alpha, num_classes=num_classes) for mix, alpha in asked]
    return BatchMix(mixes[0] if len(mixes) == 1 else v2.RandomChoice(mixes), args.seed)
