"""What the launchers build only when asked: each function here is entered by one `if` of theirs,
and a default run enters none (on a GPU, prepare_gpu and training_extras).

    decoded_once, device_loaders   --cache, --device-augment: the pictures decoded once
    initial_weights                --weights, --freeze-layers
    prepare_gpu                    cuDNN's autotuning, the side stream a CUDA graph is captured on
    training_extras                --ema, --mixup-alpha/--cutmix-alpha, --bn-recalibrate, the CUDA graph
"""
from __future__ import annotations

import argparse
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from model import freeze_backbone
from multi_train_utils.checkpoint import load_weights
from multi_train_utils.distributed_utils import DistContext
from multi_train_utils.train_eval_utils import Extras
from my_dataset import CropDraws, MyDataSet, eval_resize, size_schedule
from recipe.ema import WeightAverage
from recipe.mixing import build_mix
from recipe.recalibrate import recalibration
from speed.cuda_graph import graphed_step, use_side_stream, wanted
from speed.device_augment import DeviceAugmentedLoader, device_crops
from speed.gpu_decode import validation_on_device
from speed.image_cache import shared_cache
from utils import DataSplit


def decoded_once(split: DataSplit, train_set: MyDataSet, val_set: MyDataSet, args: argparse.Namespace,
                 ctx: DistContext) -> tuple[MyDataSet | CropDraws, MyDataSet]:
    """--cache: both sets read the pictures from shared memory, decoded once per machine.
    --device-augment: the training pictures decoded once into the device's memory, and the
    training set only draws each image's crop and flip (CropDraws, which keeps the pictures for
    device_loaders). Collectives: --cache's all_gather, broadcast and 3 barriers;
    --device-augment's all_gather and 2 all_reduces."""
    cache = shared_cache(split, vars(args), ctx) if args.cache else None
    if cache is not None:
        train_set.cache = val_set.cache = cache
    if args.device_augment and not args.eval_only:
        crops = device_crops(split, eval_resize(args.img_size), ctx, cache)
        train_set = CropDraws(split.train, crops.frames.tolist(), args.seed, args.crop_scale, args.flip)
        train_set.crops = crops
    return train_set, val_set


def device_loaders(train_loader: DataLoader, val_loader: DataLoader, args: argparse.Namespace,
                   ctx: DistContext) -> tuple[DeviceAugmentedLoader | DataLoader, Any]:
    """--device-augment: each batch of draws cut from the pictures on the device, in one call; on
    a GPU the validation images decoded once by nvJPEG and kept there too."""
    crops = getattr(train_loader.dataset, "crops", None)
    if crops is None:  # --eval-only: nothing is trained
        return train_loader, val_loader
    if ctx.device.type == "cuda":
        val_loader = validation_on_device(val_loader.dataset, val_loader.sampler, args.batch_size, ctx, ctx.cpus)
    return DeviceAugmentedLoader(train_loader, crops, size_schedule(vars(args))), val_loader


def initial_weights(model: nn.Module, args: argparse.Namespace, ctx: DistContext) -> None:
    """--weights (a file, or `imagenet`), and --freeze-layers: the classifier alone trains."""
    if args.weights:
        load_weights(model, args.weights, ctx.print0, args.model)
    if args.freeze_layers:
        freeze_backbone(model)


def prepare_gpu(args: argparse.Namespace, ctx: DistContext) -> None:
    """Before the DDP wrap, on a GPU: cuDNN autotunes its kernels for the fixed input sizes (it
    pays off from step 2); and where the step is graphed, a side stream becomes the current one:
    a graph cannot be captured on the default stream, and DDP keeps its gradient hooks on the
    stream current when it was built."""
    torch.backends.cudnn.benchmark = True
    if wanted(args, ctx.device):
        use_side_stream(ctx.device)
        ctx.print0("training step: a CUDA graph, replayed (--cuda-graph)")


def training_extras(model: nn.Module, model_without_ddp: nn.Module, optimizer: torch.optim.Optimizer,
                    split: DataSplit, args: argparse.Namespace, ctx: DistContext) -> Extras:
    """--ema's weight average of `model_without_ddp`, MixUp/CutMix, --bn-recalibrate, and on a GPU
    the CUDA graph of `model`'s step: each None where not asked for."""
    return Extras(ema=WeightAverage(model_without_ddp, args.ema_decay) if args.ema else None,
                  mix=build_mix(args, model_without_ddp),
                  recalibrate=recalibration(split, args),
                  graph=graphed_step(optimizer, model, args, ctx.device))
