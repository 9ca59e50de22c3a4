"""The one command line of all three launchers, and the checks made before any process starts.

Configuration flows one way: command line -> `args` -> printed once -> stored in the run
folder and in every checkpoint.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path

import torch

from model import DEFAULT_MODEL, check_model_name
from multi_train_utils.checkpoint import load_checkpoint, read_state_dict
from multi_train_utils.distributed_utils import Ranks, env_ranks, parse_device, parse_dist_url, resolve_device
from my_dataset import AUTO_AUGMENT, CROP_SCALE
from recipe.budget import BUDGET_MOST_EPOCHS, DEFAULT_EPOCHS, budget_seconds
from speed.cuda_graph import blockers
from utils import Sample, UserError, download_flower_photos, given_split, list_given_split, list_images

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


class BoolFlag(argparse.Action):
    """`--x` and `--x true` turn it on; `--no-x` and `--x false` turn it off.

    The original scripts used `type=bool`, for which `--syncBN False` means True. Here the
    value, when given, is parsed strictly, so old command lines keep their intended meaning.
    """

    def __init__(self, option_strings: list[str], dest: str, default: bool = False, help: str | None = None,
                 negatable: bool = True):
        negated = [f"--no-{s[2:]}" for s in option_strings if s.startswith("--")] if negatable else []
        super().__init__(option_strings + negated, dest, nargs="?", default=default, metavar="BOOL", help=help)

    def __call__(self, parser, namespace, value, option_string=None):  # type: ignore[override]
        on = not option_string.startswith("--no-")
        if value is not None:
            if value.lower() not in _TRUE | _FALSE:
                parser.error(f"{option_string} takes true or false, not {value!r}")
            on = on == (value.lower() in _TRUE)
        setattr(namespace, self.dest, on)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Show a default only where the help text does not explain it already."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or "default" in (action.help or ""):
            return action.help or ""
        return super()._get_help_string(action)


def get_args_parser(description: str, launcher: str = "single") -> argparse.ArgumentParser:
    """The options every launcher shares, and the few that only `launcher` (single, launch or
    spawn) has, with the original scripts' spellings in a group of their own."""
    p = argparse.ArgumentParser(description=description, formatter_class=_HelpFormatter)
    data = p.add_argument_group("data")
    data.add_argument("--data-path", default="dataset/flower_photos",
                      help="one sub-folder of images per class; or train/ and val/, each with the same class folders "
                           "(the split as given)")
    data.add_argument("--download", action=BoolFlag, help="fetch flower_photos.tgz into --data-path when it is missing")
    data.add_argument("--val-rate", type=float, default=0.2,
                      help="share of each class held out for validation (unused where --data-path holds train/ and val/)")
    data.add_argument("--num-classes", type=int, default=None,
                      help="number of classes; inferred from the folders, and checked against them when given")
    data.add_argument("--img-size", type=int, default=224, help="training crop; validation resizes to img/0.875 and crops")
    data.add_argument("--val-img-size", type=int, default=None,
                      help="evaluate at this size instead (resized to size/0.875, centre-cropped); a little larger "
                           "than the training crop often scores better (default: --img-size)")
    data.add_argument("--bn-recalibrate", type=int, default=0, metavar="N",
                      help="before each evaluation, recompute the BatchNorm statistics at the evaluation size on N "
                           "training images, on a copy of the weights (FixRes); evaluation, best.pth, predict.py "
                           "and export.py use them (default 0: off)")
    data.add_argument("--min-img-size", type=int, default=None,
                      help="progressive resizing: the training crop of epoch 1, a multiple of 16, growing to "
                           "--img-size by --ramp-epochs in multiples of 16 (default: --img-size throughout)")
    data.add_argument("--ramp-epochs", type=int, default=0, help="the epoch by which the crop reaches --img-size")
    data.add_argument("--cache", action=BoolFlag,
                      help="decode and resize every image once and keep the pixels in shared memory "
                           "(one copy per machine), so epochs after the first skip JPEG decoding")
    data.add_argument("--workers", type=int, default=None,
                      help="data-loader processes per training process (default: CPUs per process - 1; on the CPU at most 8)")

    train = p.add_argument_group("training")
    train.add_argument("--epochs", type=int, default=None,
                       help=f"the most epochs the run trains (default: {DEFAULT_EPOCHS}; with --time-budget alone, "
                            f"as many as fit, up to {BUDGET_MOST_EPOCHS})")
    train.add_argument("--time-budget", default=None, metavar="DURATION",
                       help="train and evaluate for at most this long (600 or 600s, 10m, 1.5h), a resumed run what "
                            "is left of it: epoch 1 is timed, and the schedule is sized to the epochs that fit (at "
                            "most --epochs when given)")
    train.add_argument("--batch-size", type=int, default=16, help="images per process and step")
    train.add_argument("--lr", type=float, default=0.1,
                       help="learning rate for a global batch of 256; the run uses lr * global_batch / 256")
    train.add_argument("--lrf", type=float, default=0.01, help="final learning rate as a fraction of the peak")
    train.add_argument("--momentum", type=float, default=0.9, help="SGD's momentum (Nesterov's, unless 0)")
    train.add_argument("--weight-decay", type=float, default=5e-5, help="applied to weights, not to BatchNorm or biases")
    train.add_argument("--warmup-epochs", type=float, default=1.0,
                       help="linear warm-up before the decay (under --time-budget the decay starts at epoch 2 at "
                            "the earliest)")
    train.add_argument("--lr-decay", default="cosine", choices=["cosine", "linear"],
                       help="the learning rate's decay from the peak to --lrf x peak: a half cosine, or a straight "
                            "line (with --lrf 0, the linear decay to zero that suits short budgets)")
    train.add_argument("--label-smoothing", type=float, default=0.1,
                       help="the share of each target spread evenly over all classes, in the loss")
    train.add_argument("--accum-steps", type=int, default=1,
                       help="batches per optimizer step (gradient accumulation): the global batch, which --lr "
                            "scales with, is --batch-size x processes x this")
    train.add_argument("--clip-grad-norm", type=float, default=None, help="clip the gradient to this norm")
    train.add_argument("--ema", action=BoolFlag,
                       help="keep an exponential moving average of the weights, evaluate it beside them each "
                            "epoch, and let best.pth hold whichever scored better")
    train.add_argument("--ema-decay", type=float, default=0.995, help="per optimizer step")
    train.add_argument("--seed", type=int, default=0, help="seeds the split, the initial weights and the augmentation")

    aug = p.add_argument_group("augmentation", "on top of the random resized crop and the horizontal flip")
    aug.add_argument("--crop-scale", type=float, default=CROP_SCALE,
                     help="the random resized crop's smallest share of the picture's area (ImageNet's 0.08; a "
                          "larger one, such as fastai's 0.35, is gentler on a small model or short training)")
    aug.add_argument("--flip", default="random", choices=["random", "alternate"],
                     help="the horizontal flip: a coin per image and epoch, or alternate: each image mirrored "
                          "in every other epoch, starting from a coin in epoch 1 (Jordan 2024)")
    aug.add_argument("--auto-augment", default="none", choices=list(AUTO_AUGMENT),
                     help="torchvision's TrivialAugmentWide, RandAugment or AugMix")
    aug.add_argument("--random-erase", type=float, default=0.0, help="probability of erasing a rectangle")
    aug.add_argument("--mixup-alpha", type=float, default=0.0, help="MixUp within each batch when above 0")
    aug.add_argument("--cutmix-alpha", type=float, default=0.0,
                     help="CutMix within each batch when above 0 (with MixUp too: one of the two per batch)")
    aug.add_argument("--tta", action=BoolFlag, help="evaluate on the mean logits of each image and its mirror")

    model = p.add_argument_group("model")
    model.add_argument("--model", default=DEFAULT_MODEL, metavar="NAME",
                       help="any torchvision classification model (torchvision.models.list_models()); the "
                            "classifier head gets one output per class folder")
    model.add_argument("--weights", default=None,
                       help="initial weights: a state dict, one of our checkpoints, or 'imagenet' (that model's "
                            "default ImageNet weights, with a new head)")
    model.add_argument("--zero-init-residual", action=BoolFlag,
                       help="ResNets: start each residual block's last BatchNorm at zero, so the network starts "
                            "as a shallow one (torchvision's zero_init_residual)")
    model.add_argument("--blurpool", action=BoolFlag,
                       help="blur the input of every strided convolution before it (BlurPool, the cheap form "
                            "MosaicML's Composer uses): downsampling without aliasing")
    model.add_argument("--freeze-layers", action=BoolFlag, help="train only the classifier")
    model.add_argument("--sync-bn", action=BoolFlag,
                       help="BatchNorm statistics over all processes (multi-process runs only)")

    speed = p.add_argument_group("speed")
    speed.add_argument("--amp", default="auto", choices=["auto", "bf16", "fp16", "off"],
                       help="mixed precision; auto: bf16 where the hardware runs it natively (CUDA from Ampere on, "
                            "CPUs with AVX512-BF16 or AMX), fp16 with loss scaling on older GPUs, else off")
    speed.add_argument("--channels-last", action=BoolFlag, default=True,
                       help="NHWC memory layout, which the convolution kernels of GPUs and CPUs prefer")
    speed.add_argument("--compile", action=BoolFlag, help="torch.compile the model (pays off only on long runs)")
    speed.add_argument("--cuda-graph", default="auto", choices=["auto", "on", "off"],
                       help="replay the training step as one CUDA graph, captured after a few eager steps: small "
                            "batches at the GPU's speed; auto: on a GPU, unless --accum-steps, --compile or --sync-bn")
    speed.add_argument("--device-augment", action=BoolFlag,
                       help="decode the training images once into the device's memory (img/0.875 px squares) and "
                            "crop, resize and flip each batch there in one call, so the loader workers only draw "
                            "the crops: for a GPU the CPUs cannot feed. Crop and flip only (not with "
                            "--auto-augment or --random-erase)")

    run = p.add_argument_group("run")
    run.add_argument("--device", default=None,
                     help="cuda, cuda:N, N (GPU N) or cpu (default: cuda when present, else cpu); with several "
                          "processes per machine each takes the GPU of its local rank, so give the type only")
    if launcher == "spawn":
        run.add_argument("--world-size", type=int, default=None,
                         help="number of processes (default: the number of visible GPUs)")
    run.add_argument("--output-dir", default=None, help="run folder (default: runs/<launcher>-<time>)")
    run.add_argument("--resume", default=None, metavar="PATH|auto",
                     help="continue from a checkpoint; 'auto' takes <output-dir>/last.pth when it exists")
    run.add_argument("--drop-missing", action=BoolFlag,
                     help="on --resume: go on without the run's files that are gone or no longer decode (else an error)")
    run.add_argument("--data-moved", action=BoolFlag,
                     help="on --resume: the run's files moved to --data-path, each at the same place under it")
    run.add_argument("--eval-only", action=BoolFlag,
                     help="evaluate --resume on its run's validation images (its split.json), or --weights on "
                     "--data-path's validation split")
    run.add_argument("--plots", action=BoolFlag, default=True,
                     help="draw the run's PNGs at its end (a few seconds); `python plots.py RUN_DIR` draws them later")
    run.add_argument("--backend", default=None, choices=["nccl", "gloo"],
                     help="process-group backend (default: nccl on CUDA, gloo on the CPU)")
    run.add_argument("--dist-timeout", type=float, default=1800,
                     help="seconds a collective may wait for a peer before the job fails")
    run.add_argument("--check", action="store_true",
                     help="diagnose the setup instead of training: device, rendezvous address and port, memory, "
                          "data, output folder, the processes joining, versions, a checked all-reduce, bus "
                          "bandwidth, one timed step alone and under DDP; exit 0 when a job would run, 1 when not")
    run.add_argument("--check-timeout", type=float, default=20,
                     help="seconds each --check stage may take before it counts as hung")
    if launcher != "single":  # one process meets no one
        run.add_argument("--trace-collectives", action="store_true",
                         help="record every collective each rank makes in Python (DDP's and SyncBatchNorm's "
                              "included) with the launcher line that led to it: rank 0 prints them by line after each "
                              "epoch, and each rank's list goes to RUN_DIR/collectives/ (steps eagerly: a CUDA graph "
                              "hides them)")

    old = p.add_argument_group("the original scripts' spellings",
                               "accepted so that their command lines and job scripts run unchanged")
    old.add_argument("--num_classes", dest="num_classes", type=int, default=None, help="same as --num-classes")
    old.add_argument("--syncBN", dest="sync_bn", action=BoolFlag, negatable=False,
                     help="same as --sync-bn; --syncBN False means off")
    if launcher == "spawn":
        old.add_argument("--dist-url", default="env://",
                         help="where the processes meet: tcp://HOST:PORT, or env:// for MASTER_ADDR/MASTER_PORT "
                              "(unset: a free port on 127.0.0.1)")
    if launcher == "launch":
        old.add_argument("--dist-url", default="env://",
                         help="env:// or tcp://HOST:PORT; accepted, but the address torchrun or srun sets wins")
        old.add_argument("--world-size", type=int, default=None,
                         help="checked against the world size torchrun or srun gives")
        # torch.distributed.launch without --use_env passes the local rank as an argument.
        old.add_argument("--local-rank", "--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    return p


@dataclasses.dataclass(frozen=True)
class Plan:
    """What every training process needs before it starts: checked args, the image files, and
    how many processes the job has (for the torchrun launcher, which one this is)."""

    args: argparse.Namespace
    launcher: str
    class_names: list[str]
    samples: list[Sample]
    world_size: int = 1
    ranks: Ranks | None = None  # torchrun's or srun's ranks (the torchrun launcher); None: no job yet
    val_files: frozenset[str] | None = None  # a folder split already: its val/ images; None: --val-rate draws them


def read_command_line(launcher: str, description: str) -> argparse.Namespace:
    """The command line of `launcher` ("single", "launch" or "spawn"), parsed: --help and a
    malformed option end here, as argparse ends them."""
    return get_args_parser(description.splitlines()[0], launcher).parse_args()


def check_and_list_images(args: argparse.Namespace, launcher: str, verbose: bool = True) -> Plan:
    """Check the command line, download the flower photos (--download, where the folder is
    missing) and list every image, before any collective, so that a user mistake is one clear
    error in every process, never a hung job. The torchrun launcher reads
    who this process is from torchrun's (or srun's) environment here, and checks --world-size
    against it; the spawn launcher, how many processes to start. `verbose`: this process may
    print (the first of each machine does)."""
    rdzv, world_size = None, 1
    if launcher == "launch":
        rdzv = env_ranks(args.local_rank)
        world_size = rdzv.world_size if rdzv else 1
        if args.world_size is not None and args.world_size != world_size:
            raise UserError(f"--world-size is {args.world_size}, but {world_size} process(es) were started: "
                            "start as many as you ask for (torchrun --nproc_per_node, srun --ntasks), or drop it")
    if launcher == "spawn":
        gpus = torch.cuda.device_count() if parse_device(args.device).type == "cuda" else 0
        world_size = args.world_size or gpus
        if world_size < 1:
            raise UserError("no GPU is visible: pass --world-size N to train with N CPU processes (gloo)")
        if gpus and world_size > gpus:
            raise UserError(f"--world-size {world_size} is more than the {gpus} visible GPU(s)")
        resolve_device(args.device, 0, world_size, distributed=True)  # what every process would check, once
    check_options(args, launcher)
    log = print if verbose and (rdzv is None or rdzv.local_rank == 0) else _quiet
    if args.download and not Path(args.data_path).is_dir():
        # torchrun starts every process at once; a file lock inside lets one of them download.
        download_flower_photos(args.data_path, log=log)
    val_files = None
    if folders := given_split(args.data_path):  # train/ and val/: the split is the folder's own
        class_names, samples, val_files = list_given_split(*folders, args.num_classes, log=log)
    else:
        class_names, samples = list_images(args.data_path, args.num_classes, log=log)
    if launcher == "launch" and (rdzv is None or rdzv.rank == 0) and parse_dist_url(args.dist_url):
        where = (f"the one torchrun or srun set, {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}" if rdzv
                 else "not needed for one process")
        print(f"--dist-url {args.dist_url} is not used: the rendezvous is {where}")
    if launcher == "launch" and rdzv is None and not args.check:
        print("not started by torchrun or srun: training in one process")
    return Plan(args, launcher, class_names, samples, world_size, rdzv, val_files)


def check_options(args: argparse.Namespace, launcher: str) -> None:
    if not 0 < args.val_rate < 1:
        raise UserError(f"--val-rate must be between 0 and 1 (exclusive), not {args.val_rate}")
    for name in ("epochs", "batch_size", "accum_steps", "img_size", "val_img_size", "min_img_size"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1")
    check_recipe(args)
    budget_seconds(args)  # a malformed --time-budget fails here
    check_model_name(args.model, args.zero_init_residual)
    if args.check_timeout <= 0:
        raise UserError("--check-timeout must be positive")
    if args.workers is not None and args.workers < 0:
        raise UserError("--workers cannot be negative")
    if args.bn_recalibrate < 0:
        raise UserError("--bn-recalibrate cannot be negative")
    if args.num_classes is not None and args.num_classes < 2:
        raise UserError("--num-classes must be at least 2")
    if args.eval_only and not (args.resume or args.weights):
        raise UserError("--eval-only needs --resume PATH or --weights PATH to evaluate")
    device = parse_device(args.device)  # a malformed --device fails here, before any process starts
    if args.cuda_graph == "on" and device.type != "cuda":
        raise UserError(f"--cuda-graph on needs a GPU, not {device}: CUDA graphs are NVIDIA's")
    if args.cuda_graph == "on" and blockers(args):
        raise UserError(f"--cuda-graph on cannot run with {'; '.join(blockers(args))}")
    parse_dist_url(getattr(args, "dist_url", "env://"))
    if getattr(args, "trace_collectives", False) and args.check:
        raise UserError("--trace-collectives records a training run's collectives; --check trains none (its own "
                        "job's are listed in docs/how-it-works.md, \"Where the ranks meet\")")
    if (args.drop_missing or args.data_moved) and not args.resume:
        raise UserError("--drop-missing and --data-moved are about a resumed run's files: they need --resume")
    if args.resume == "auto" and args.output_dir is None:
        raise UserError("--resume auto needs --output-dir (it looks for <output-dir>/last.pth)")
    if args.weights and args.weights != "imagenet":
        read_state_dict(args.weights)  # exists and holds tensors, or a UserError
    if args.resume and args.resume != "auto":
        load_checkpoint(args.resume, mmap=True)  # mapped, so checking costs little


def check_recipe(args: argparse.Namespace) -> None:
    if args.min_img_size is not None and args.min_img_size % 16:
        # The ramp's crops are rounded to multiples of 16: any other size would not be epoch 1's
        # (40 trains at 32, 8 at 0 pixels).
        raise UserError(f"--min-img-size must be a multiple of 16 (16, 32, 48, ...), not {args.min_img_size}")
    if args.min_img_size is not None and args.min_img_size > args.img_size:
        raise UserError(f"--min-img-size {args.min_img_size} is above --img-size {args.img_size}")
    if args.min_img_size is not None and args.min_img_size < args.img_size and args.ramp_epochs < 2:
        raise UserError("--min-img-size needs --ramp-epochs 2 or more: the epoch by which the crop is full size")
    if not 0 < args.crop_scale <= 1:
        raise UserError(f"--crop-scale is a share of the picture's area, above 0 and at most 1, not {args.crop_scale}")
    if not 0 <= args.random_erase <= 1:
        raise UserError(f"--random-erase is a probability, not {args.random_erase}")
    if args.mixup_alpha < 0 or args.cutmix_alpha < 0:
        raise UserError("--mixup-alpha and --cutmix-alpha cannot be negative")
    if not 0 < args.ema_decay < 1:
        raise UserError(f"--ema-decay must be between 0 and 1 (exclusive), not {args.ema_decay}")
    if args.clip_grad_norm is not None and args.clip_grad_norm <= 0:
        raise UserError("--clip-grad-norm must be positive")
    if args.device_augment and (args.auto_augment != "none" or args.random_erase > 0):
        raise UserError("--device-augment crops and flips on the device; --auto-augment and --random-erase run in "
                        "the loader workers: choose one or the other")


def _quiet(_: str) -> None:
    pass
