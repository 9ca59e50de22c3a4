"""The one command line of all three launchers, and the checks made before any process starts.

Configuration flows one way: command line -> `args` -> printed once -> stored in the run
folder and in every checkpoint.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import re
import socket
import urllib.parse
from pathlib import Path

import torch

from model import DEFAULT_MODEL, check_model_name
from multi_train_utils.checkpoint import load_checkpoint, read_state_dict
from multi_train_utils.distributed_utils import Ranks, parse_device, resolve_device
from my_dataset import AUTO_AUGMENT, CROP_SCALE
from utils import SPLIT_FOLDERS, Sample, UserError, download_flower_photos, given_split, list_given_split, list_images

# --epochs when it is not given; with --time-budget alone, the budget decides, up to a limit that only
# tiny folders reach.
DEFAULT_EPOCHS, BUDGET_MOST_EPOCHS = 30, 1000  # (--time-budget alone: as many epochs as fit, up to 1000)


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
            if value.lower() not in {"1", "true", "yes", "on", "0", "false", "no", "off"}:
                parser.error(f"{option_string} takes true or false, not {value!r}")
            on = on == (value.lower() in {"1", "true", "yes", "on"})
        setattr(namespace, self.dest, on)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Show a default only where the help text does not explain it already."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or "default" in (action.help or ""):
            return action.help or ""
        return super()._get_help_string(action)


def get_args_parser(description: str, launcher: str = "single") -> argparse.ArgumentParser:
    """The options every launcher shares, and the few that only `launcher` (single, launch or
    spawn) has; `description`: the launcher's docstring, whose first line --help shows. Each
    option's help is a line: docs/options.md says more of each."""
    p = argparse.ArgumentParser(description=description.splitlines()[0], formatter_class=_HelpFormatter)
    data = p.add_argument_group("data").add_argument
    data("--data-path", default="dataset/flower_photos", help="one folder of images per class, or train/ and val/ ones")
    data("--download", action=BoolFlag, help="fetch flower_photos.tgz into --data-path when it is missing")
    data("--val-rate", type=float, default=0.2, help="share of each class held out for validation")
    data("--num-classes", type=int, default=None, help="inferred from the folders; checked against them when given")
    data("--img-size", type=int, default=224, help="training crop; validation resizes to img/0.875 and crops")
    data("--val-img-size", type=int, default=None, help="evaluate at this size instead (default: --img-size)")
    data("--bn-recalibrate", type=int, default=0, metavar="N", help="BatchNorm's statistics from N images before evaluating")
    data("--min-img-size", type=int, default=None, help="progressive resizing: epoch 1's crop, a multiple of 16")
    data("--ramp-epochs", type=int, default=0, help="the epoch by which the crop grows to --img-size")
    data("--check-images", action=BoolFlag, help="decode every image at start-up; leave out those that do not decode")
    data("--cache", action=BoolFlag, help="decode every image once, into shared memory: one copy per machine")
    data("--workers", type=int, default=None, help="loader processes a process (default: its CPUs - 1; CPU: 8 at most)")
    train = p.add_argument_group("training").add_argument
    train("--epochs", type=int, default=None, help=f"default {DEFAULT_EPOCHS}; under --time-budget, what fits")
    train("--time-budget", default=None, metavar="DURATION", help="train for at most 600 (s), 10m or 1.5h")
    train("--batch-size", type=int, default=16, help="images per process and step")
    train("--lr", type=float, default=0.1, help="learning rate for a global batch of 256 (lr x global batch / 256)")
    train("--lrf", type=float, default=0.01, help="final learning rate, as a fraction of the peak")
    train("--momentum", type=float, default=0.9, help="SGD's momentum (Nesterov's, unless 0)")
    train("--weight-decay", type=float, default=5e-5, help="on weights, not on BatchNorm or biases")
    train("--warmup-epochs", type=float, default=1.0, help="linear warm-up before the decay")
    train("--lr-decay", default="cosine", choices=["cosine", "linear"], help="the decay to --lrf x peak")
    train("--label-smoothing", type=float, default=0.1, help="the share of each target spread over all classes")
    train("--accum-steps", type=int, default=1, help="batches per optimizer step (gradient accumulation)")
    train("--clip-grad-norm", type=float, default=None, help="clip the gradient to this norm")
    train("--ema", action=BoolFlag, help="evaluate an average of the weights too; best.pth holds the better")
    train("--ema-decay", type=float, default=0.995, help="--ema's decay per optimizer step")
    train("--seed", type=int, default=0, help="seeds the split, the initial weights and the augmentation")
    aug = p.add_argument_group("augmentation", "on top of the random resized crop and the flip").add_argument
    aug("--crop-scale", type=float, default=CROP_SCALE, help="the random crop's smallest share of the picture's area")
    aug("--flip", default="random", choices=["random", "alternate"], help="a coin per image and epoch, or alternate")
    aug("--auto-augment", default="none", choices=list(AUTO_AUGMENT), help="TrivialAugmentWide, RandAugment or AugMix")
    aug("--random-erase", type=float, default=0.0, help="probability of erasing a rectangle")
    aug("--mixup-alpha", type=float, default=0.0, help="MixUp within each batch, when above 0")
    aug("--cutmix-alpha", type=float, default=0.0, help="CutMix within each batch, when above 0")
    aug("--tta", action=BoolFlag, help="evaluate on the mean logits of each image and its mirror")
    model = p.add_argument_group("model").add_argument
    model("--model", default=DEFAULT_MODEL, metavar="NAME", help="any of torchvision.models.list_models()'s")
    model("--weights", default=None, help="a state dict, a checkpoint, or imagenet (a new head)")
    model("--zero-init-residual", action=BoolFlag, help="ResNets: each block's last BatchNorm starts at zero")
    model("--blurpool", action=BoolFlag, help="blur the input of each strided convolution (BlurPool)")
    model("--freeze-layers", action=BoolFlag, help="train only the classifier")
    model("--sync-bn", action=BoolFlag, help="BatchNorm statistics over all processes")
    speed = p.add_argument_group("speed").add_argument
    speed("--amp", default="auto", choices=["auto", "bf16", "fp16", "off"], help="auto: bf16 where native, fp16 on old GPUs")
    speed("--channels-last", action=BoolFlag, default=True, help="NHWC memory layout")
    speed("--compile", action=BoolFlag, help="torch.compile the model")
    speed("--cuda-graph", default="auto", choices=["auto", "on", "off"], help="the step as a CUDA graph (auto: 1 GPU)")
    speed("--device-augment", action=BoolFlag, help="the training images decoded once on the device, cropped there")
    run = p.add_argument_group("run").add_argument
    run("--device", default=None, help="cuda, cuda:N, N or cpu (default: cuda when present); a job: the type only")
    if launcher == "spawn":
        run("--world-size", type=int, default=None, help="number of processes (default: one per visible GPU)")
    run("--output-dir", default=None, help="run folder (default: runs/<launcher>-<time>)")
    run("--resume", default=None, metavar="PATH|auto", help="continue from a checkpoint; auto: <output-dir>/last.pth")
    run("--drop-missing", action=BoolFlag, help="resume without the run's files that are gone or do not decode")
    run("--data-moved", action=BoolFlag, help="resume with the run's files moved to --data-path")
    run("--eval-only", action=BoolFlag, help="evaluate --resume's run (its split.json), or --weights")
    run("--report", action=BoolFlag, help="at the end, best.pth's report per class (report.json)")
    run("--plots", action=BoolFlag, help="at the end, the run's PNGs (plots.py RUN_DIR draws them any time)")
    run("--scaling", action=BoolFlag, help="at the end, what the processes bought (scaling.json)")
    run("--backend", default=None, choices=["nccl", "gloo"], help="default: nccl on CUDA, gloo on the CPU")
    run("--dist-timeout", type=float, default=1800, help="seconds a rank waits for its peers before the job fails")
    run("--check", action="store_true", help="diagnose the setup instead of training: exit 0 when a job would run")
    run("--check-timeout", type=float, default=20, help="seconds each --check stage may take")
    if launcher != "single":  # one process meets no one
        run("--trace-collectives", action="store_true", help="list every collective, by the launcher line behind it")
    old = p.add_argument_group("the original scripts' spellings", "their command lines run unchanged").add_argument
    old("--num_classes", dest="num_classes", type=int, default=None, help="same as --num-classes")
    old("--syncBN", dest="sync_bn", action=BoolFlag, negatable=False, help="same as --sync-bn; --syncBN False: off")
    if launcher != "single":
        old("--dist-url", default="env://", help="tcp://HOST:PORT, or env://: MASTER_ADDR and MASTER_PORT"
            + (" (unset: a free port on 127.0.0.1)" if launcher == "spawn" else " (torchrun's or srun's win)"))
    if launcher == "launch":
        old("--world-size", type=int, default=None, help="checked against the world size torchrun or srun gives")
        # torch.distributed.launch without --use_env passes the local rank as an argument.
        old("--local-rank", "--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    return p


@dataclasses.dataclass(frozen=True)
class Plan:
    """What every training process needs before it starts: the checked command line, the image
    files, and how many processes the job has (for the torchrun launcher, which one this is)."""

    args: argparse.Namespace
    launcher: str
    class_names: list[str]
    samples: list[Sample]
    world_size: int = 1
    ranks: Ranks | None = None  # torchrun's or srun's ranks (the torchrun launcher); None: no job yet
    val_files: frozenset[str] | None = None  # a folder split already: its val/ images; None: --val-rate draws them


def check_options(args: argparse.Namespace, launcher: str, ranks: Ranks | None = None) -> None:
    """A mistake in the command line: one `error:` line in every process, before any of them talks
    to another, never a hung job. `ranks`: torchrun's or srun's, for the torchrun launcher."""
    if not 0 < args.val_rate < 1:
        raise UserError(f"--val-rate must be between 0 and 1 (exclusive), not {args.val_rate}")
    for name in ("epochs", "batch_size", "accum_steps", "img_size", "val_img_size", "min_img_size", "num_classes"):
        if getattr(args, name) is not None and getattr(args, name) < (2 if name == "num_classes" else 1):
            raise UserError(f"--{name.replace('_', '-')} must be at least {2 if name == 'num_classes' else 1}")
    if args.model != DEFAULT_MODEL or args.zero_init_residual:  # one of torchvision's, and a ResNet for that
        check_model_name(args.model, args.zero_init_residual)
    parse_device(args.device)  # a malformed --device fails here, before any process starts
    if args.resume or args.weights or args.eval_only or args.drop_missing or args.data_moved or args.check:
        check_run_options(args)
    if (args.time_budget is not None or args.min_img_size or args.ema or args.device_augment or args.random_erase
            or args.crop_scale != CROP_SCALE or args.clip_grad_norm is not None or args.cuda_graph == "on"
            or args.workers or args.bn_recalibrate or args.mixup_alpha or args.cutmix_alpha):
        check_recipe(args)
    if launcher == "launch" and (args.world_size or args.dist_url != "env://" or "GLOO_SOCKET_IFNAME" in os.environ):
        check_job_options(args, ranks)


def check_job_options(args: argparse.Namespace, ranks: Ranks | None) -> None:
    """What the torchrun launcher's --world-size, --dist-url and GLOO_SOCKET_IFNAME need."""
    if args.world_size is not None and args.world_size != (ranks.world_size if ranks else 1):
        raise UserError(f"--world-size is {args.world_size}, but {ranks.world_size if ranks else 1} process(es) were "
                        "started: start as many as you ask for (torchrun --nproc_per_node, srun --ntasks), or drop it")
    if "GLOO_SOCKET_IFNAME" in os.environ:  # an interface this machine lacks: torch's traceback in the rendezvous
        check_socket_interfaces(os.environ["GLOO_SOCKET_IFNAME"])
    if parse_dist_url(args.dist_url) and (ranks is None or ranks.rank == 0):
        where = (f"the one torchrun or srun set, {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}" if ranks
                 else "not needed for one process")
        print(f"--dist-url {args.dist_url} is not used: the rendezvous is {where}")


def check_run_options(args: argparse.Namespace) -> None:
    """What --resume, --weights, --eval-only and --check need."""
    if args.check_timeout <= 0:
        raise UserError("--check-timeout must be positive")
    if args.eval_only and not (args.resume or args.weights):
        raise UserError("--eval-only needs --resume PATH or --weights PATH to evaluate")
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


def check_socket_interfaces(names: str) -> None:
    """GLOO_SOCKET_IFNAME's interfaces (a comma-separated list) exist on this machine."""
    have = [name for _, name in socket.if_nameindex()]
    if missing := [name for name in names.split(",") if name not in have]:
        raise UserError(f"GLOO_SOCKET_IFNAME names {', '.join(missing)}, which this machine ({socket.gethostname()}) "
                        f"does not have: its interfaces are {', '.join(have)}")


def spawn_world_size(args: argparse.Namespace) -> int:
    """How many processes the spawn launcher starts: --world-size, else one per visible GPU."""
    gpus = torch.cuda.device_count() if parse_device(args.device).type == "cuda" else 0
    world_size = args.world_size or gpus
    if world_size < 1:
        raise UserError("no GPU is visible: pass --world-size N to train with N CPU processes (gloo)")
    if gpus and world_size > gpus:
        raise UserError(f"--world-size {world_size} is more than the {gpus} visible GPU(s)")
    resolve_device(args.device, 0, world_size, distributed=True)  # what every process would check, once
    return world_size


def list_images_of(args: argparse.Namespace, launcher: str, ranks: Ranks | None = None, world_size: int = 1,
                   verbose: bool = True) -> Plan:
    """--download's flower photos (a file lock lets one process of a machine download), and every image
    of --data-path. `verbose`: this process may print (each machine's first)."""
    log = print if verbose and (ranks is None or ranks.local_rank == 0) else _quiet
    if args.download and not Path(args.data_path).is_dir():
        download_flower_photos(args.data_path, log=log)
    val_files, path = None, Path(args.data_path)
    if path.is_dir() and {d.name for d in path.iterdir()} & set(SPLIT_FOLDERS):  # train/ and val/: split already
        class_names, samples, val_files = list_given_split(*given_split(args.data_path), args.num_classes, log=log)
    else:
        class_names, samples = list_images(args.data_path, args.num_classes, log=log)
    if launcher == "launch" and ranks is None and not args.check:
        print("not started by torchrun or srun: training in one process")
    return Plan(args, launcher, class_names, samples, ranks.world_size if ranks else world_size, ranks, val_files)


def parse_dist_url(url: str) -> tuple[str, int] | None:
    """`--dist-url` (the original scripts' init_method): None for env://, else (host, port)."""
    if url == "env://":
        return None
    parts = urllib.parse.urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme != "tcp" or not parts.hostname or not port:
        raise UserError(f"--dist-url {url!r} is not env:// or tcp://HOST:PORT")
    return parts.hostname, port


def check_recipe(args: argparse.Namespace) -> None:
    """What the options beyond the defaults need."""
    for name in ("workers", "bn_recalibrate", "mixup_alpha", "cutmix_alpha"):
        if getattr(args, name) is not None and getattr(args, name) < 0:
            raise UserError(f"--{name.replace('_', '-')} cannot be negative")
    budget_seconds(args)  # a malformed --time-budget fails here
    if args.cuda_graph == "on" and parse_device(args.device).type != "cuda":
        raise UserError(f"--cuda-graph on needs a GPU, not {parse_device(args.device)}: CUDA graphs are NVIDIA's")
    if args.cuda_graph == "on" and blockers(args):
        raise UserError(f"--cuda-graph on cannot run with {'; '.join(blockers(args))}")
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
    if not 0 < args.ema_decay < 1:
        raise UserError(f"--ema-decay must be between 0 and 1 (exclusive), not {args.ema_decay}")
    if args.clip_grad_norm is not None and args.clip_grad_norm <= 0:
        raise UserError("--clip-grad-norm must be positive")
    if args.device_augment and (args.auto_augment != "none" or args.random_erase > 0):
        raise UserError("--device-augment crops and flips on the device; --auto-augment and --random-erase run in "
                        "the loader workers: choose one or the other")


def blockers(args: argparse.Namespace) -> list[str]:
    """The options a step replayed as a CUDA graph cannot run with (speed/cuda_graph.py)."""
    found = []
    if args.accum_steps > 1:
        found.append("--accum-steps (a step of several batches, each backward but the last without DDP's sync)")
    if args.compile:
        found.append("--compile (torch.compile's code was not tried inside a captured graph)")
    if getattr(args, "trace_collectives", False):
        found.append("--trace-collectives (a replayed graph makes its collectives without Python, unseen)")
    return found


def parse_duration(text: str) -> float:
    """Seconds in `600`, `600s`, `10m` or `1.5h`."""
    match = re.fullmatch(r"(\d+\.?\d*|\.\d+)([smh]?)", text.strip())
    if not match or float(match[1]) == 0:
        raise UserError(f"--time-budget takes a positive duration such as 600 (seconds), 10m or 1.5h, not {text!r}")
    return float(match[1]) * {"": 1, "s": 1, "m": 60, "h": 3600}[match[2]]


def budget_seconds(args: argparse.Namespace) -> float | None:
    return None if args.time_budget is None else parse_duration(args.time_budget)


def _quiet(_: str) -> None:
    pass
