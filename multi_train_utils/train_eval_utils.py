"""Training and evaluation: the optimizer and its learning rate, one training epoch (forward,
`loss.backward()`, `optimizer.step()`), exact evaluation, and how far a run has come. Each
collective is made here, in the function the launcher calls, and named in its docstring."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from model import batch_norm_statistics, set_train_mode
from multi_train_utils.distributed_utils import DistContext, all_reduce_min, all_reduce_sum, broadcast_buffers
from my_dataset import normalize
from utils import TrainingDiverged, queued_seconds

# Steps between the ranks' looks at the run (a small all_reduce and a host sync each, so the loop
# never waits on the device at every step): every 20, or about every 5 s where steps are slow. A
# SIGTERM is acted on at the next look; schedulers send SIGKILL 30 s after their SIGTERM.
CHECK_EVERY, LOOK_SECONDS = 20, 5.0


@dataclasses.dataclass
class Progress:
    """How far a run has come: what a checkpoint records beyond the weights and the optimizer."""

    epoch: int = 0  # epochs done
    best_acc: float = -1.0
    last_epoch: int = 30  # the run's last epoch (--epochs, or what --time-budget fits)
    # A run stopped inside epoch `epoch + 1` (SIGTERM): the batches each process had trained in it,
    # its sums so far (loss x images, correct, images) over every process, its seconds of training.
    steps_in_epoch: int = 0
    epoch_sums: tuple[float, float, float] = (0.0, 0.0, 0.0)
    epoch_seconds: float = 0.0
    # --time-budget's: the epochs it fixed after epoch 1, the seconds of the epochs done, the longest
    # training of one, and epoch 1's training and evaluation seconds.
    budget_epochs: int | None = None
    seconds_used: float = 0.0
    slowest_train: float = 0.0
    first_epoch: tuple[float, float] | None = None
    resumed_at: int = 1  # the first epoch this process trains (not saved)

    def finish_epoch(self, epoch: int, trained: Trained, evaluated: Evaluation) -> bool:
        """Note a finished epoch; whether it scored best so far."""
        train_seconds = self.epoch_seconds + trained.seconds  # after those trained before a stop inside it
        if epoch == 1:
            self.first_epoch = (train_seconds, evaluated.seconds)
        self.epoch, self.steps_in_epoch, self.epoch_sums, self.epoch_seconds = epoch, 0, (0.0, 0.0, 0.0), 0.0
        self.seconds_used += train_seconds + evaluated.seconds
        self.slowest_train = max(self.slowest_train, train_seconds)
        acc = max(evaluated.val["val_acc"], evaluated.val.get("ema_val_acc", 0.0))  # --ema: best.pth holds the better
        is_best, self.best_acc = acc > self.best_acc, max(self.best_acc, acc)
        return is_best


@dataclasses.dataclass(frozen=True)
class Extras:
    """The step's and the evaluation's options beyond the defaults (recipe/extras.py builds them):
    --ema's weight average, MixUp/CutMix, --bn-recalibrate, a CUDA graph of the step."""

    ema: Any = None
    mix: Any = None
    recalibrate: Any = None
    graph: Any = None


def global_batch(args: argparse.Namespace, ctx: DistContext) -> int:
    """Images per optimizer step: the batch of every process, times the batches accumulated."""
    return args.batch_size * ctx.world_size * args.accum_steps


def learning_rate(step: int, steps_per_epoch: int, epochs: int, args: argparse.Namespace, ctx: DistContext) -> float:
    """The learning rate at the run's step `step`: --lr per 256 images of global batch at the peak
    (the linear scaling rule), after a linear warm-up, then a half cosine (or a line) to --lrf x
    peak; under --time-budget the decay starts at epoch 2, before which the count is not known."""
    peak, total = args.lr * global_batch(args, ctx) / 256, max(1, epochs * steps_per_epoch)
    warmup = round(args.warmup_epochs * steps_per_epoch)
    warmup = warmup if args.time_budget else min(total - 1, warmup)
    if step < warmup:
        return peak * (step + 1) / (warmup + 1)
    start = max(warmup, steps_per_epoch if args.time_budget else 0)
    done = min(1.0, max(0, step - start) / max(1, total - start))
    falls = 1 - done if args.lr_decay == "linear" else 0.5 * (1 + math.cos(math.pi * done))
    return peak * (args.lrf + (1 - args.lrf) * falls)


def build_optimizer(model: nn.Module, args: argparse.Namespace, amp_dtype: torch.dtype | None
                    ) -> tuple[torch.optim.Optimizer, torch.amp.GradScaler]:
    """SGD with Nesterov momentum over `model`'s parameters (after any layer swap: over the ones
    it has then), its learning rate set at every step, and the loss scaler beside it."""
    params = [p for p in model.parameters() if p.requires_grad]  # no weight decay on BatchNorm's scales and biases
    groups = [{"params": [p for p in params if p.ndim > 1], "weight_decay": args.weight_decay},
              {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0}]
    # The fused kernel updates every parameter in one pass.
    optimizer = torch.optim.SGD(groups, lr=0.0, momentum=args.momentum, nesterov=args.momentum > 0, fused=True)
    if args.momentum > 0:
        # Zero momentum to start from: fused SGD makes its buffers with empty_like at its first step, and
        # skips that step whole when fp16 gradients overflowed, which would leave them uninitialised.
        for param in params:
            optimizer.state[param]["momentum_buffer"] = torch.zeros_like(param, memory_format=torch.preserve_format)
    # Loss scaling keeps small fp16 gradients from flushing to zero; bf16 has fp32's range.
    scaler = torch.amp.GradScaler(next(model.parameters()).device.type, enabled=amp_dtype == torch.float16)
    return optimizer, scaler


def model_input(images: torch.Tensor, device: torch.device, channels_last: bool = True) -> torch.Tensor:
    """A loader batch as the model takes it: uint8 pixels cross to the device in the model's memory
    format and become normalised floats there; a float batch (--device-augment's) is already."""
    images = images.to(device, non_blocking=True,
                       memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    return normalize(images) if images.dtype == torch.uint8 else images


def next_look(step: int, seconds_per_step: float) -> int:
    """The step after which the ranks look next, having looked after `step`: at the slowest rank's
    pace (the look's all_reduce gives every rank the same), so every rank looks at the same steps."""
    every = max(1, min(CHECK_EVERY, int(LOOK_SECONDS / max(seconds_per_step, 1e-9))))
    return ((step + 1) // every + 1) * every - 1


@dataclasses.dataclass(frozen=True)
class Trained:
    """An epoch's training over every rank: its loss and accuracy; the images its whole epoch and
    this pass drew; seconds, and seconds waiting for data (the mean over ranks); the learning rate
    where it left the schedule; the sums a stopped epoch's position holds; the batches each rank
    trained in the epoch; `stopped`: the batch after which a SIGTERM stopped every rank, or 0."""

    train_loss: float
    train_acc: float
    epoch_images: int
    train_images: int
    seconds: float
    data_wait_seconds: float
    lr: float
    sums: tuple[float, float, float]
    batches: int
    stopped: int = 0
    seconds_per_step: float = 0.0
    cpu_queued_seconds: float = 0.0  # the training thread's wait for a CPU taken by other programs (the mean)


def train_one_epoch(model: nn.Module, criterion: nn.Module, optimizer: torch.optim.Optimizer,
                    scaler: torch.amp.GradScaler, loader: Iterable, epoch: int, progress: Progress,
                    amp_dtype: torch.dtype | None, args: argparse.Namespace, ctx: DistContext,
                    extra: Extras = Extras(), stop_requested: Callable[[], bool] = lambda: False) -> Trained:
    """One pass over this rank's shard of the training images (after a stop inside the epoch, the
    rest of it): per batch the forward pass and `loss.backward()`, and on the batch that closes an
    optimizer step (--accum-steps) the step. Collectives: DDP's all-reduce of the gradients in each
    closing backward(); after the first step, then at least every 20, an all_reduce(MIN) of 3
    numbers (a non-finite loss on any rank ends the run, a SIGTERM on any rank stops every rank
    after this step, the slowest rank's pace); one all_reduce(SUM) of the epoch's sums."""
    started, queued = time.perf_counter(), queued_seconds()
    k, done = args.accum_steps, progress.steps_in_epoch
    batches = done + len(loader)
    steps_per_epoch = math.ceil(batches / k)
    epochs = progress.budget_epochs or progress.last_epoch
    set_train_mode(model)  # a frozen backbone's BatchNorm stays in eval mode
    # Loss x images and correct on the device (only the looks wait for them), images on the host; rank 0 adds a stop's.
    sums = torch.tensor(progress.epoch_sums[:2] if ctx.is_main else (0.0, 0.0), dtype=torch.float64, device=ctx.device)
    images, waited, stopped, look_at, pace = progress.epoch_sums[2] if ctx.is_main else 0, 0.0, 0, done // k, 0.0
    # A bar on rank 0 only, and only on a terminal (disable=None): logs stay free of it.
    bar = tqdm(loader, desc=f"epoch {epoch}/{epochs}", disable=None if ctx.is_main else True, leave=False,
               dynamic_ncols=True)
    asked = time.perf_counter()
    for batch, (inputs, labels) in enumerate(bar, start=done):
        waited += time.perf_counter() - asked
        step, closes = (epoch - 1) * steps_per_epoch + batch // k, (batch + 1) % k == 0 or batch + 1 == batches
        torch.manual_seed(hash((args.seed, ctx.rank, epoch, batch)) % 2**63)  # dropout's draws: each rank its own
        inputs, labels = model_input(inputs, ctx.device, args.channels_last), labels.to(ctx.device, non_blocking=True)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, steps_per_epoch, epochs, args, ctx)
        targets = labels
        if extra.mix:  # MixUp/CutMix: mixed images, soft targets
            inputs, targets = extra.mix(inputs, labels, (epoch - 1) * steps_per_epoch * k + batch)
        replayed = extra.graph.replay(inputs, targets, model, criterion, optimizer, scaler, amp_dtype,
                                      args.clip_grad_norm) if extra.graph else None
        if replayed:  # on one GPU by default: the step below, replayed as one CUDA graph
            loss, logits = replayed
        else:
            # DDP all-reduces the gradients in the backward of a step's last batch; those before it add up locally.
            with contextlib.nullcontext() if closes or not ctx.distributed else model.no_sync():
                with torch.autocast(ctx.device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                    logits = model(inputs)
                    loss = criterion(logits, targets)
                scaler.scale(loss / min(k, batches - batch // k * k)).backward()  # the step: the mean of its batches
            if closes:
                if args.clip_grad_norm is not None:
                    scaler.unscale_(optimizer)  # clip the true gradient, not the fp16-scaled one
                    nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad_norm)
                scaler.step(optimizer)  # optimizer.step(), unless fp16 gradients overflowed
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
        if closes and extra.ema:  # --ema's average follows the weights
            extra.ema.update(step + 1)
        sums += torch.stack([loss.detach().double() * len(labels), (logits.argmax(1) == labels).sum().double()])
        images += len(labels)
        if closes and (batch // k >= look_at or batch + 1 == batches):
            micros = 1e6 * (time.perf_counter() - started) / (batch + 1 - done)
            # all_reduce(MIN): whether every rank's loss is still finite, whether a SIGTERM came, the slowest pace.
            finite, stop, slowest = all_reduce_min(torch.stack([
                torch.isfinite(sums[0]).long(), torch.tensor(-int(stop_requested()), device=ctx.device),
                torch.tensor(-int(micros), device=ctx.device)]), ctx).tolist()
            if not finite:
                raise TrainingDiverged(f"the loss became NaN or infinite at epoch {epoch}, by step {batch + 1} of "
                                       f"{batches}: lower --lr, or check the data")
            if stop:
                stopped = batch + 1
                break
            pace = -slowest * k / 1e6
            look_at = next_look(batch // k, pace)
            if ctx.is_main:
                bar.set_postfix(loss=f"{sums[0] / images:.4f}", acc=f"{sums[1] / images:.3f}", refresh=False)
        asked = time.perf_counter()
    bar.close()
    # all_reduce: the epoch's sums over every rank, once.
    host = sums.new_tensor([images, waited, queued_seconds() - queued])
    loss_sum, correct, count, waits, queues = all_reduce_sum(torch.cat([sums, host]), ctx).tolist()
    return Trained(loss_sum / max(count, 1), correct / max(count, 1), int(count), int(count - progress.epoch_sums[2]),
                   time.perf_counter() - started, waits / ctx.world_size,
                   learning_rate(epoch * steps_per_epoch, steps_per_epoch, epochs, args, ctx), (loss_sum, correct, count),
                   stopped or batches, stopped, pace, queues / ctx.world_size)


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """An epoch's evaluation: the metrics (the weight average's as ema_*), which weights scored
    higher ("model" or "ema"), the BatchNorm statistics --bn-recalibrate recomputed for them, the
    seconds it took, and whether a SIGTERM stopped it."""

    val: dict[str, float]
    better: str = "model"
    evaluated_bn: dict[str, torch.Tensor] | None = None
    seconds: float = 0.0
    stopped: bool = False


@torch.no_grad()
def evaluate(model: nn.Module, loader: Iterable, args: argparse.Namespace, ctx: DistContext,
             extra: Extras = Extras(), stop_requested: Callable[[], bool] = lambda: False,
             seconds_per_step: float = 0.0) -> Evaluation:
    """The exact validation metrics of `model` (unwrapped: no DDP, not compiled), in fp32, each
    image counted once at any world size, with rank 0's BatchNorm statistics (the ones it saves);
    under --ema, its average's too. Collectives, per model: a broadcast per dtype of its buffers;
    after the first batch, then about every 5 s (at the training's `seconds_per_step`), an
    all_reduce(MIN): whether a SIGTERM came; one all_reduce(SUM) of the shard's sums."""
    started = time.perf_counter()
    modules, results, evaluated_bn = {"model": model, **({"ema": extra.ema.module} if extra.ema else {})}, {}, None
    shared_batches = math.ceil(len(loader.dataset) // ctx.world_size / loader.batch_size)  # every rank has these
    for name, module in modules.items():
        broadcast_buffers(module, ctx)  # broadcast: rank 0's BatchNorm statistics
        if extra.recalibrate:  # a copy with statistics at the evaluation size; broadcast: rank 0's
            module = extra.recalibrate(module, ctx)
        module.eval()
        sums, look_at = torch.zeros(3, dtype=torch.float64, device=ctx.device), 0
        for batch, (images, labels) in enumerate(loader):
            inputs, labels = model_input(images, ctx.device, args.channels_last), labels.to(ctx.device, non_blocking=True)
            logits = module(inputs)
            if args.tta:  # the mean logits of each image and its mirror, the one augmentation every image had
                logits = (logits + module(inputs.flip(3))) / 2
            loss = nn.functional.cross_entropy(logits.float(), labels, reduction="sum")
            sums += torch.stack([loss.double(), (logits.argmax(1) == labels).sum().double(), loss.new_tensor(len(labels)).double()])
            if batch == look_at and batch < shared_batches:
                if all_reduce_min(torch.tensor(-int(stop_requested()), device=ctx.device), ctx).item():  # all_reduce(MIN)
                    return Evaluation({}, seconds=time.perf_counter() - started, stopped=True)
                look_at = next_look(batch, seconds_per_step / 3)  # a batch forward alone: about a third of a step
        loss_sum, correct, count = all_reduce_sum(sums, ctx).tolist()  # all_reduce: each image once
        results[name] = {"val_loss": loss_sum / count, "val_acc": correct / count, "val_correct": int(correct),
                         "val_total": int(count)}
        if extra.recalibrate:
            evaluated_bn = {**(evaluated_bn or {}), name: batch_norm_statistics(module)}
    val = dict(results["model"], **{f"ema_{k}": v for k, v in results.get("ema", {}).items()})
    better = "ema" if "ema" in results and results["ema"]["val_acc"] > val["val_acc"] else "model"
    return Evaluation(val, better, evaluated_bn[better] if evaluated_bn else None, time.perf_counter() - started)
