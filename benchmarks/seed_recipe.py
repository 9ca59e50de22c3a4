"""The seed recipe, frozen: WZMIAOMIAO's train_multi_GPU scripts as this project found them.

Kept apart from the project so that changes to the project cannot move the baseline: only
the split and the model (ResNet34) are the project's, so that the recipe alone differs.
"""
from __future__ import annotations

import argparse
import math
import os
import time
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from PIL import Image
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import BatchSampler, DataLoader, Dataset, DistributedSampler
from torchvision import transforms as v1

from model import create_model
from multi_train_utils.distributed_utils import DistContext, all_reduce_sum, process_context
from multi_train_utils.train_eval_utils import evaluate
from my_dataset import IMAGENET_MEAN, IMAGENET_STD, eval_resize
from utils import DataSplit, Sample, TrainingDiverged

# The seed recipe's hyper-parameters (train_multi_gpu_using_launch.py of the original repository).
SEED_LR = 0.001  # multiplied by the number of processes, as the seed did
SEED_LRF = 0.1
SEED_MOMENTUM = 0.9
SEED_WEIGHT_DECAY = 5e-3


def seed_transforms(img_size: int) -> tuple[v1.Compose, v1.Compose]:
    """The seed's v1 transforms, with its 224/256 sizes scaled to `img_size`."""
    normalize = v1.Normalize(IMAGENET_MEAN, IMAGENET_STD)
    train = v1.Compose([v1.RandomResizedCrop(img_size), v1.RandomHorizontalFlip(), v1.ToTensor(), normalize])
    val = v1.Compose([v1.Resize(eval_resize(img_size)), v1.CenterCrop(img_size), v1.ToTensor(), normalize])
    return train, val


class SeedDataSet(Dataset):
    """The seed's MyDataSet: every access opens the JPEG with PIL and decodes it at full size."""

    def __init__(self, samples: list[Sample], transform: v1.Compose):
        self.samples = samples
        self.transform = transform

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        path, label = self.samples[index]
        img = Image.open(path)
        if img.mode != "RGB":  # the seed raised here; converting keeps odd files from ending a benchmark
            img = img.convert("RGB")
        return self.transform(img), label


def seed_loader(samples: list[Sample], transform: v1.Compose, batch_size: int, ctx: DistContext,
                train: bool) -> tuple[DataLoader, DistributedSampler]:
    """The seed's loader: a DistributedSampler (shuffling, seed 0) in every process,
    min(CPUs, batch, 8) workers per process, pinned memory, full batches only when training."""
    warnings.filterwarnings("ignore", message=".*pin_memory.*")  # pinning without a GPU is a no-op
    dataset = SeedDataSet(samples, transform)
    sampler = DistributedSampler(dataset, num_replicas=ctx.world_size, rank=ctx.rank)
    workers = min(os.cpu_count() or 1, batch_size if batch_size > 1 else 0, 8)
    if train:
        loader = DataLoader(dataset, batch_sampler=BatchSampler(sampler, batch_size, drop_last=True),
                            pin_memory=True, num_workers=workers)
    else:
        loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, pin_memory=True, num_workers=workers)
    return loader, sampler


def seed_model_and_optimizer(num_classes: int, seed: int, ctx: DistContext) -> tuple[nn.Module, torch.optim.SGD]:
    """The model in DDP when distributed, and the seed's SGD: weight decay on every parameter."""
    torch.manual_seed(seed)  # the same initial weights as ours (the seed broadcast rank 0's through a file)
    model = create_model(num_classes).to(ctx.device)
    if ctx.distributed:
        model = DDP(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=SEED_LR * ctx.world_size, momentum=SEED_MOMENTUM,
                                weight_decay=SEED_WEIGHT_DECAY)
    return model, optimizer


def seed_train_one_epoch(model: nn.Module, optimizer: torch.optim.Optimizer, loader: Iterable,
                         ctx: DistContext, epoch: int) -> float:
    """The seed's train_one_epoch: fp32, NCHW; every step all-reduces the loss, and the host
    waits for it twice (the progress bar's mean loss on rank 0, the finiteness check everywhere)."""
    model.train()
    loss_function = nn.CrossEntropyLoss()
    mean_loss = torch.zeros(1, device=ctx.device)
    optimizer.zero_grad()
    bar = _seed_bar(loader, ctx)
    for step, (images, labels) in enumerate(bar):
        pred = model(images.to(ctx.device))
        loss = loss_function(pred, labels.to(ctx.device))
        loss.backward()
        loss = all_reduce_sum(loss.detach().clone(), ctx) / ctx.world_size
        mean_loss = (mean_loss * step + loss) / (step + 1)
        if ctx.is_main:
            bar.desc = f"[epoch {epoch}] mean loss {round(mean_loss.item(), 3)}"
        if not torch.isfinite(loss):
            raise TrainingDiverged(f"seed recipe: non-finite loss at epoch {epoch}, step {step}")
        optimizer.step()
        optimizer.zero_grad()
    return mean_loss.item()


def _seed_bar(loader: Iterable, ctx: DistContext) -> Any:
    from tqdm import tqdm

    # disable=None: a bar on a terminal only, as in the project's loop, so logs stay clean.
    return tqdm(loader, disable=None if ctx.is_main else True, leave=False)


def train_seed(args: argparse.Namespace, split: DataSplit, log: Callable[[str], None]) -> list[dict[str, Any]]:
    """The seed's training loop and schedule, in this process, on the project's split and model."""
    ctx = process_context(None, None)
    epochs = args.epochs
    train_tf, val_tf = seed_transforms(args.img_size)
    model, optimizer = seed_model_and_optimizer(len(split.class_names), args.seed, ctx)
    train_loader, train_sampler = seed_loader(split.train, train_tf, args.batch_size, ctx, train=True)
    val_loader, _ = seed_loader(split.val, val_tf, args.batch_size, ctx, train=False)

    def cosine(x: int) -> float:  # the seed's lf, stepped once per epoch
        return ((1 + math.cos(x * math.pi / epochs)) / 2) * (1 - SEED_LRF) + SEED_LRF

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=cosine)
    # The project's exact evaluation, fed as the seed fed its model: NCHW, no mirrored copy (--tta).
    seed_eval = argparse.Namespace(**{**vars(args), "channels_last": False, "tta": False})
    records = []
    for epoch in range(epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.perf_counter()
        lr = optimizer.param_groups[0]["lr"]
        train_loss = seed_train_one_epoch(model, optimizer, train_loader, ctx, epoch)
        scheduler.step()
        train_seconds = time.perf_counter() - t0
        # At one process the project's exact evaluation counts what the seed's did: argmax hits / images.
        val = evaluate(model, val_loader, seed_eval, ctx).val
        records.append({"epoch": epoch + 1, "train_loss": train_loss, **val, "lr": lr, "epoch_seconds": train_seconds,
                        "eval_seconds": time.perf_counter() - t0 - train_seconds})
        log(f"seed epoch {epoch + 1}/{epochs}: train loss {train_loss:.4f}, val acc {val['val_acc']:.4f}, "
            f"{train_seconds:.1f}s")
    return records
