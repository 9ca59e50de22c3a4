"""--bn-recalibrate N: before each evaluation, BatchNorm statistics recomputed at the evaluation
size on N training images, on a copy of the weights (FixRes's cheap half)."""
from __future__ import annotations

import argparse
import copy
import functools
from collections.abc import Callable, Sequence

import torch
from torch import nn

from model import batch_norms
from multi_train_utils.distributed_utils import DistContext, broadcast_buffers
from multi_train_utils.train_eval_utils import model_input
from my_dataset import MyDataSet, build_transform, eval_img_size, eval_resize
from utils import DataSplit


def recalibration(split: DataSplit, args: argparse.Namespace) -> BatchNormRecalibration | None:
    """--bn-recalibrate's, its images prepared on first use; None without it."""
    if not args.bn_recalibrate:
        return None
    return BatchNormRecalibration(functools.cache(lambda: recalibration_batches(split, args)), args.channels_last)


def recalibration_batches(split: DataSplit, args: argparse.Namespace) -> list[torch.Tensor]:
    """--bn-recalibrate's images: N training images spread evenly over the split (every class
    in its share), prepared as validation images are, in batches of --batch-size; uint8, a
    few MiB. The same on every rank."""
    n = min(args.bn_recalibrate, len(split.train))
    size = eval_img_size(vars(args))
    chosen = MyDataSet([split.train[i * len(split.train) // n] for i in range(n)],
                       build_transform(size, train=False), eval_resize(size))
    images = torch.stack([chosen[i][0] for i in range(n)])
    return list(images.split(args.batch_size))


class BatchNormRecalibration:
    """--bn-recalibrate: FixRes's cheap half (Touvron et al. 2019). A model trained on random
    crops and evaluated on larger centre crops sees larger objects at evaluation, and its
    BatchNorm statistics, averaged over the training crops, no longer fit. Before evaluating,
    a copy of the weights gets statistics recomputed on training images prepared as the
    validation images are (resized and centre-cropped at the evaluation size), forward only:
    each BatchNorm's mean and variance averaged over the batches, as
    torch.optim.swa_utils.update_bn computes them. The weights being trained keep theirs.

    `batches`: gives the uint8 batches, every rank the same ones (the same copy then comes out
    on every rank, at any world size)."""

    def __init__(self, batches: Callable[[], Sequence[torch.Tensor]], channels_last: bool = True):
        self.batches = batches
        self.channels_last = channels_last

    @torch.no_grad()
    def __call__(self, model: nn.Module, ctx: DistContext) -> nn.Module:
        """A copy of `model` (on its device) with the recomputed statistics. Collective: a
        broadcast of rank 0's."""
        module = copy.deepcopy(model)
        for norm in batch_norms(module):
            norm.reset_running_stats()
            norm.momentum = None  # a plain average over the batches, not a moving one
        module.train()
        for images in self.batches():
            module(model_input(images, ctx.device, self.channels_last))
        module.eval()
        broadcast_buffers(module, ctx)  # GPU kernels need not repeat to the bit: rank 0's, everywhere
        return module
