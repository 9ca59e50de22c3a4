"""The training run every launcher shares: data, model, loop, exact evaluation, outputs.

`run(plan, ctx)` is the only entry point: it behaves the same in one process and in N, the
differences being confined to `DistContext` and the reductions in distributed_utils.
"""
from __future__ import annotations

import ctypes
import dataclasses
import json
import math
import signal
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

from model import (
    convert_sync_batchnorm,
    create_model,
    freeze_backbone,
    load_weights,
    set_train_mode,
)
from multi_train_utils.checkpoint import copy_atomic, load_checkpoint, save_atomic
from multi_train_utils.config import Plan, split_summary
from multi_train_utils.distributed_utils import (
    DistContext,
    ShardSampler,
    all_reduce_min,
    all_reduce_sum,
    broadcast_buffers,
    broadcast_object,
    cpu_count,
    gather_objects,
)
from my_dataset import (
    EpochSampler,
    MyDataSet,
    SharedImageCache,
    build_transform,
    eval_resize,
    normalize,
)
from plots import save_run_plots
from utils import (
    DataSplit,
    TrainingDiverged,
    UserError,
    drop_unreadable,
    find_unreadable,
    split_samples,
)

# Steps between looks at the loss on the host: each look is one small collective and one
# host sync, so the loop never waits on the device at every step.
CHECK_EVERY = 20
NO_BAD_STEP = 2**62


def readable_split(plan: Plan, ctx: DistContext) -> DataSplit:
    """Leave out files that do not decode, then split. Each rank decodes 1/world_size of the
    files and the ranks swap their findings, so every rank ends with the same split."""
    paths = [p for p, _ in plan.samples]
    mine = find_unreadable(paths[ctx.rank :: ctx.world_size], threads=torch.get_num_threads())
    unreadable = dict(pair for part in gather_objects(mine, ctx) for pair in part)
    for path, reason in sorted(unreadable.items()):
        ctx.print0(f"warning: leaving out {path}: {reason}")
    samples = drop_unreadable(plan.samples, plan.class_names, unreadable)
    return split_samples(samples, plan.class_names, plan.args.val_rate, plan.args.seed)


def prepare_output_dir(plan: Plan, ctx: DistContext) -> Path:
    """Rank 0 picks and creates the run folder and proves it can write there; every rank
    learns the outcome, so an unwritable folder stops all of them before training."""
    path, error = None, None
    if ctx.is_main:
        path = plan.args.output_dir or f"runs/{plan.launcher}-{time.strftime('%Y%m%d-%H%M%S')}"
        try:
            Path(path).mkdir(parents=True, exist_ok=True)
            probe = Path(path) / ".write-test"
            probe.write_bytes(b"")
            probe.unlink()
            for stale in Path(path).glob(".*.pth*.tmp"):  # left by a process killed while saving
                stale.unlink()
        except OSError as e:
            error = f"cannot write to the output folder {path!r}: {e.strerror or e}"
    path, error = broadcast_object((path, error), ctx)
    if error:
        raise UserError(error)
    return Path(path)


def default_workers(ctx: DistContext) -> int:
    # Leave one core of this process's share to the training loop itself.
    spare = cpu_count() // ctx.local_world_size - 1
    if ctx.device.type == "cuda":
        # One core decodes and augments about 900 images/s (README, Performance); a GPU is
        # meant to train 8,000/s. So the loader gets every spare core.
        return max(1, spare)
    # On the CPU the training step itself runs on every core; workers only stay a few batches ahead.
    return max(1, min(8, spare))


def die_with_parent(_worker_id: int) -> None:
    """A loader worker ends the moment its training process does, however that one ended.
    Otherwise a worker orphaned by SIGKILL lingers until PyTorch's watchdog notices, holding the
    job's terminal or log pipe open after the launcher has gone."""
    if sys.platform == "linux":
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG


def build_loaders(split: DataSplit, plan: Plan, ctx: DistContext) -> tuple[DataLoader, DataLoader]:
    args = plan.args
    workers = default_workers(ctx) if args.workers is None else args.workers
    common = dict(
        batch_size=args.batch_size,
        num_workers=workers,
        persistent_workers=workers > 0,
        worker_init_fn=die_with_parent,
        pin_memory=ctx.device.type == "cuda",
        # A process started by mp.spawn would also spawn its loader workers, each re-importing
        # torch (seconds) and receiving a pickled copy of the dataset; forking, Linux's default
        # everywhere else, shares the parent's memory, the --cache pixels included.
        multiprocessing_context="fork" if workers > 0 and sys.platform == "linux" else None,
    )
    cache = None
    if args.cache:
        started = time.perf_counter()
        cache = SharedImageCache([p for p, _ in split.train + split.val], eval_resize(args.img_size), ctx)
        ctx.print0(f"cache: {len(cache.shapes)} images, {cache.nbytes / 2**20:.0f} MiB of shared memory, one copy "
                   f"for the {ctx.local_world_size} process(es) on this machine, filled in "
                   f"{time.perf_counter() - started:.1f}s")
    train_set = MyDataSet(split.train, build_transform(args.img_size, train=True), args.img_size, args.seed, cache)
    val_set = MyDataSet(split.val, build_transform(args.img_size, train=False), eval_resize(args.img_size),
                        cache=cache)
    # Every process, the single one included, draws from a DistributedSampler: one code path.
    train_sampler = EpochSampler(
        DistributedSampler(train_set, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True, seed=args.seed)
    )
    # A last batch of one image breaks BatchNorm in training mode; drop the remainder instead
    # (the shuffle changes which images fall in it every epoch).
    drop_last = len(train_sampler) > args.batch_size
    train_loader = DataLoader(train_set, sampler=train_sampler, drop_last=drop_last, **common)
    val_loader = DataLoader(val_set, sampler=ShardSampler(len(val_set), ctx), **common)
    return train_loader, val_loader


def build_optimizer(model: nn.Module, args: Any, lr: float) -> torch.optim.Optimizer:
    # Weight decay on BatchNorm scales and biases only fights the normalisation.
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.ndim > 1 else no_decay).append(param)
    groups = [
        {"params": decay, "weight_decay": args.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    # The fused kernel updates all parameters in one pass; it exists for CPU and CUDA tensors.
    return torch.optim.SGD(groups, lr=lr, momentum=args.momentum, nesterov=args.momentum > 0, fused=True)


def autocast_dtype(choice: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype for `--amp`, or None for full fp32."""
    if choice == "off":
        return None
    if choice == "fp16":
        return torch.float16
    if choice == "bf16":
        return torch.bfloat16
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else torch.float16
    # Without native bf16 instructions the CPU emulates it, slower than fp32.
    cpu = torch.cpu
    native = getattr(cpu, "_is_avx512_bf16_supported", lambda: False)() or getattr(cpu, "_is_amx_tile_supported", lambda: False)()
    return torch.bfloat16 if device.type == "cpu" and native else None


def build_scheduler(optimizer: torch.optim.Optimizer, args: Any, steps_per_epoch: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up, then cosine decay from the peak to `lrf * peak`, stepped every batch."""
    total = max(1, args.epochs * steps_per_epoch)
    warmup = min(total - 1, round(args.warmup_epochs * steps_per_epoch))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return args.lrf + (1 - args.lrf) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def set_schedule_position(scheduler: torch.optim.lr_scheduler.LambdaLR, peak_lr: float, steps_done: int) -> None:
    """Put the schedule where `steps_done` steps of this run's length would have left it."""
    scheduler.base_lrs = [peak_lr] * len(scheduler.optimizer.param_groups)
    scheduler.last_epoch = steps_done
    for group, factor in zip(scheduler.optimizer.param_groups, scheduler.lr_lambdas):
        group["initial_lr"] = peak_lr
        group["lr"] = peak_lr * factor(steps_done)


def peak_lr(args: Any, ctx: DistContext) -> float:
    """The linear scaling rule: `--lr` is per 256 images of global batch."""
    return args.lr * args.batch_size * ctx.world_size / 256


def place_model(model: nn.Module, args: Any, ctx: DistContext) -> tuple[torch.memory_format, torch.dtype | None]:
    """Move the model to the device in its memory format; returns that format and the autocast dtype."""
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
    model.to(ctx.device, memory_format=memory_format)
    if ctx.device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # fixed input sizes: autotuned kernels pay off from step 2
    return memory_format, autocast_dtype(args.amp, ctx.device)


@dataclasses.dataclass
class Training:
    """What a training step needs, assembled once by `build_training`."""

    model: nn.Module  # as the loop calls it: in DDP and compiled where asked
    model_without_ddp: nn.Module  # what is saved, evaluated and resumed
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    scaler: torch.amp.GradScaler
    criterion: nn.Module
    amp_dtype: torch.dtype | None
    memory_format: torch.memory_format

    def train_one_epoch(self, loader: Iterable, ctx: DistContext, epoch: int, epochs: int) -> dict[str, float]:
        return train_one_epoch(self.model, loader, self.criterion, self.optimizer, self.scheduler, self.scaler, ctx,
                               epoch, epochs, self.amp_dtype, self.memory_format)


def build_training(model: nn.Module, args: Any, ctx: DistContext, lr: float, steps_per_epoch: int,
                   memory_format: torch.memory_format, amp_dtype: torch.dtype | None) -> Training:
    """Wrap a placed model for training (SyncBatchNorm, DDP, compile) and build its optimizer,
    schedule, loss scaler and loss, as every launcher and the benchmark train it."""
    if args.sync_bn and ctx.distributed:
        model = convert_sync_batchnorm(model, ctx.device)
    model_without_ddp = model
    if ctx.distributed:
        model = DDP(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
    if args.compile:
        model = torch.compile(model)  # checkpoints and evaluation use the uncompiled model_without_ddp
    optimizer = build_optimizer(model_without_ddp, args, lr)
    scheduler = build_scheduler(optimizer, args, steps_per_epoch)
    # Loss scaling keeps small fp16 gradients from flushing to zero; bf16 has fp32's range.
    scaler = torch.amp.GradScaler(ctx.device.type, enabled=amp_dtype == torch.float16)
    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)
    return Training(model, model_without_ddp, optimizer, scheduler, scaler, criterion, amp_dtype, memory_format)


def model_input(images: torch.Tensor, device: torch.device, memory_format: torch.memory_format) -> torch.Tensor:
    """A loader batch as the model takes it. The loaders give uint8 pixels, which cross to the
    device as they are and become normalised floats there, in the model's memory format (the
    layout changes while the pixels are still one byte each). A batch that is floating point
    already (synthetic input, tests) is taken as normalised."""
    images = images.to(device, non_blocking=True, memory_format=memory_format)
    return normalize(images) if images.dtype == torch.uint8 else images


def train_one_epoch(
    model: nn.Module,
    loader: DataLoader,
    criterion: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    scaler: torch.amp.GradScaler,
    ctx: DistContext,
    epoch: int,
    epochs: int,
    amp_dtype: torch.dtype | None = None,
    memory_format: torch.memory_format = torch.contiguous_format,
) -> dict[str, float]:
    """One pass over this rank's shard. Loss and accuracy stay on the device as running sums
    and are all-reduced once at the end; the host looks at them every CHECK_EVERY steps."""
    set_train_mode(model)
    device = ctx.device
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, images
    images_seen = 0
    first_bad = torch.full((), NO_BAD_STEP, dtype=torch.int64, device=device)
    # Bars on rank 0 only, and only on a terminal (disable=None): logs stay free of them.
    bar = tqdm(loader, desc=f"epoch {epoch}/{epochs}", disable=None if ctx.is_main else True, leave=False,
               dynamic_ncols=True)
    steps = len(loader)
    for step, (images, labels) in enumerate(bar):
        images = model_input(images, device, memory_format)
        labels = labels.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            logits = model(images)
            loss = criterion(logits, labels)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()

        loss = loss.detach()
        n = labels.numel()
        # The count is known on the host; putting it in a device tensor every step would be a copy to the GPU.
        sums[:2] += torch.stack([loss.double() * n, (logits.argmax(1) == labels).sum().double()])
        images_seen += n
        # Remember the first non-finite step on the device; no sync here.
        first_bad = torch.where(~torch.isfinite(loss) & (first_bad == NO_BAD_STEP), step + 1, first_bad)
        if (step + 1) % CHECK_EVERY == 0 or step + 1 == steps:
            bad = int(all_reduce_min(first_bad.clone(), ctx))
            if bad != NO_BAD_STEP:
                raise TrainingDiverged(
                    f"the loss became NaN or infinite at epoch {epoch}, step {bad} of {steps}: "
                    "lower --lr, or check the data"
                )
            if ctx.is_main:
                loss_sum, correct = sums[:2].tolist()
                count = images_seen
                bar.set_postfix(loss=f"{loss_sum / count:.4f}", acc=f"{correct / count:.3f}",
                                lr=f"{optimizer.param_groups[0]['lr']:.2e}", refresh=False)
    bar.close()
    sums[2] = images_seen  # once per epoch
    loss_sum, correct, count = all_reduce_sum(sums, ctx).tolist()
    return {"train_loss": loss_sum / count, "train_acc": correct / count, "train_images": int(count)}


@torch.no_grad()
def evaluate(
    model: nn.Module,
    loader: DataLoader,
    ctx: DistContext,
    memory_format: torch.memory_format = torch.contiguous_format,
) -> dict[str, float]:
    """Exact accuracy and mean loss over the whole validation split: each rank sees a
    disjoint shard without padding, so every image counts exactly once. Always in fp32: it is
    a small share of the time, and bf16 rounding could differ with the batch composition,
    which changes with the world size, and flip a borderline image."""
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=ctx.device)  # loss sum, correct, images
    images_seen = 0
    criterion = nn.CrossEntropyLoss(reduction="sum")
    for images, labels in loader:
        images = model_input(images, ctx.device, memory_format)
        labels = labels.to(ctx.device, non_blocking=True)
        logits = model(images)
        sums[:2] += torch.stack([
            criterion(logits, labels).double(),
            (logits.argmax(1) == labels).sum().double(),
        ])
        images_seen += labels.numel()
    sums[2] = images_seen
    loss_sum, correct, count = all_reduce_sum(sums, ctx).tolist()
    return {"val_loss": loss_sum / count, "val_acc": correct / count, "val_correct": int(correct), "val_total": int(count)}


def write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def restore_metrics(path: Path, completed_epochs: int) -> None:
    """Keep only the epochs the checkpoint includes: a run killed after writing metrics for
    epoch k+1 but before its checkpoint must not log epoch k+1 twice once resumed."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["epoch"] <= completed_epochs:
                kept.append(line)
        except (ValueError, KeyError, TypeError):
            pass  # a line cut short by a kill mid-append
    path.write_text("".join(line + "\n" for line in kept))


def save_epoch(output_dir: Path, checkpoint: dict[str, Any], record: dict[str, Any], is_best: bool,
               writer: SummaryWriter) -> None:
    """Rank 0's files for one epoch. The checkpoint goes first: metrics.jsonl never mentions
    an epoch that a resumed run would train again."""
    save_atomic(checkpoint, output_dir / "last.pth")
    if is_best:
        copy_atomic(output_dir / "last.pth", output_dir / "best.pth")
    with open(output_dir / "metrics.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")
    for key in ("train_loss", "train_acc", "val_loss", "val_acc", "lr", "train_images_per_sec"):
        writer.add_scalar(key, record[key], record["epoch"])
    writer.flush()


def resolve_resume(plan: Plan, output_dir: Path, ctx: DistContext) -> str | None:
    resume = plan.args.resume
    if resume != "auto":
        return resume
    # Rank 0 decides, so every rank makes the same choice even if a file appears meanwhile.
    found = (output_dir / "last.pth").is_file() if ctx.is_main else None
    return str(output_dir / "last.pth") if broadcast_object(found, ctx) else None


def run(plan: Plan, ctx: DistContext) -> None:
    args = plan.args
    split = readable_split(plan, ctx)
    output_dir = prepare_output_dir(plan, ctx)
    resume_path = resolve_resume(plan, output_dir, ctx)
    global_batch = args.batch_size * ctx.world_size
    lr = peak_lr(args, ctx)
    ctx.print0(f"config: {vars(args)}")
    ctx.print0(split_summary(split))
    ctx.print0(
        f"{plan.launcher}: {ctx.world_size} process(es) on {ctx.device.type}, global batch {global_batch}, "
        f"peak lr {lr:.4g} (= {args.lr} x {global_batch}/256), output in {output_dir}"
    )

    torch.manual_seed(args.seed)  # the same initial weights on every rank and in every rerun
    model = create_model(len(split.class_names))
    if args.weights:
        load_weights(model, args.weights, ctx.print0)
    if args.freeze_layers:
        freeze_backbone(model)
    checkpoint = load_checkpoint(resume_path) if resume_path else None
    if checkpoint is not None:
        if checkpoint["class_names"] != split.class_names:
            raise UserError(
                f"{resume_path} was trained on classes {checkpoint['class_names']}, "
                f"but {args.data_path} has {split.class_names}"
            )
        model.load_state_dict(checkpoint["model"])
    memory_format, amp_dtype = place_model(model, args, ctx)
    ctx.print0(f"precision: {'fp32' if amp_dtype is None else str(amp_dtype).removeprefix('torch.') + ' autocast'}, "
               f"memory format: {'channels_last' if args.channels_last else 'NCHW'}")
    train_loader, val_loader = build_loaders(split, plan, ctx)

    if args.eval_only:
        result = evaluate(model, val_loader, ctx, memory_format)
        source = resume_path or args.weights
        ctx.print0(f"eval {source}: acc {result['val_acc']:.4f} ({result['val_correct']}/{result['val_total']}), "
                   f"loss {result['val_loss']:.4f}")
        if ctx.is_main:
            write_json(output_dir / "eval.json", {**result, "weights": source, "world_size": ctx.world_size})
        return

    training = build_training(model, args, ctx, lr, len(train_loader), memory_format, amp_dtype)
    model_without_ddp, optimizer, scheduler = training.model_without_ddp, training.optimizer, training.scheduler
    start_epoch, best_acc = 0, -1.0
    if checkpoint is not None:
        optimizer.load_state_dict(checkpoint["optimizer"])
        training.scaler.load_state_dict(checkpoint["scaler"])
        start_epoch, best_acc = checkpoint["epoch"], checkpoint["best_acc"]
        # Not the saved scheduler state: it counts steps of the saved world size. The schedule
        # is a function of epochs done, and the peak follows this run's global batch.
        set_schedule_position(scheduler, lr, start_epoch * len(train_loader))
        ctx.print0(f"resumed from {resume_path}: {start_epoch} epoch(s) done, best val_acc {best_acc:.4f}")
        del checkpoint

    writer = None
    if ctx.is_main:
        write_json(output_dir / "config.json", {**vars(args), "launcher": plan.launcher, "world_size": ctx.world_size,
                                                "torch": torch.__version__})
        write_json(output_dir / "class_indices.json", dict(enumerate(split.class_names)))
        restore_metrics(output_dir / "metrics.jsonl", start_epoch)
        writer = SummaryWriter(log_dir=str(output_dir))
    try:
        for epoch in range(start_epoch + 1, args.epochs + 1):
            train_loader.sampler.set_epoch(epoch)
            started = time.perf_counter()
            train = training.train_one_epoch(train_loader, ctx, epoch, args.epochs)
            train_seconds = time.perf_counter() - started
            broadcast_buffers(model_without_ddp, ctx)
            val = evaluate(model_without_ddp, val_loader, ctx, memory_format)
            record = {
                "epoch": epoch,
                "train_loss": train["train_loss"],
                "train_acc": train["train_acc"],
                "train_total": len(split.train),
                **val,
                "lr": optimizer.param_groups[0]["lr"],
                "epoch_seconds": train_seconds,
                "eval_seconds": time.perf_counter() - started - train_seconds,
                "train_images_per_sec": train["train_images"] / train_seconds,
                "world_size": ctx.world_size,
                "global_batch_size": global_batch,
            }
            is_best = val["val_acc"] > best_acc
            best_acc = max(best_acc, val["val_acc"])
            if ctx.is_main:
                checkpoint = {
                    "model": model_without_ddp.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(),
                    "scaler": training.scaler.state_dict(),
                    "epoch": epoch,
                    "best_acc": best_acc,
                    "args": vars(args),
                    "class_names": split.class_names,
                    "world_size": ctx.world_size,
                }
                save_epoch(output_dir, checkpoint, record, is_best, writer)
                print(
                    f"epoch {epoch}/{args.epochs}: train loss {record['train_loss']:.4f} acc {record['train_acc']:.3f} | "
                    f"val loss {val['val_loss']:.4f} acc {val['val_acc']:.4f} ({val['val_correct']}/{val['val_total']})"
                    f" | {record['train_images_per_sec']:.1f} img/s, {train_seconds:.1f}s" + (" *best*" if is_best else ""),
                    flush=True,
                )
        if ctx.is_main:
            save_run_plots(output_dir, split, args.img_size, args.seed)
        ctx.print0(f"done: best val_acc {best_acc:.4f}; checkpoints and logs in {output_dir}")
    finally:
        if writer is not None:
            writer.close()

