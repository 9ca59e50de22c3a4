"""Training and evaluation: the model built on its device, the optimizer, one training epoch
(forward, `loss.backward()`, `optimizer.step()`) and exact evaluation. Each launcher strings
them together in its own epoch loop; the collectives each makes are in its docstring."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from model import batch_norm_statistics, freeze_backbone, model_for, set_train_mode, unwrapped
from multi_train_utils.checkpoint import load_weights
from multi_train_utils.distributed_utils import DistContext, all_reduce_min, all_reduce_sum, broadcast_buffers
from multi_train_utils.progress import Progress
from my_dataset import normalize
from recipe.budget import most_epochs
from recipe.ema import WeightAverage
from recipe.mixing import build_mix
from recipe.schedule import build_schedule, peak_lr
from speed.cuda_graph import graphed_step, use_side_stream, wanted
from speed.scaling import ddp_timers
from utils import TrainingDiverged

# Steps between looks at the loss on the host: each look is one small collective and one
# host sync, so the loop never waits on the device at every step. Where steps are slow, the
# looks come more often, about every LOOK_SECONDS: a SIGTERM is acted on at the next look, and
# torchrun (like most schedulers) sends SIGKILL 30 s after its SIGTERM.
CHECK_EVERY = 20
LOOK_SECONDS = 5.0
NO_BAD_STEP = 2**62
# The clock an epoch's training and evaluation are timed by (--time-budget counts them); tests
# replace it to fake slow epochs.
clock = time.perf_counter


@dataclasses.dataclass(frozen=True)
class PlacedModel:
    """A model on its device, and how a batch is fed to it."""

    module: nn.Module  # unwrapped (no DDP, not compiled): what is saved, evaluated and resumed
    device: torch.device
    memory_format: torch.memory_format = torch.contiguous_format
    amp_dtype: torch.dtype | None = None  # autocast dtype in training; None: fp32
    tta: bool = False  # evaluation averages the logits of each image and its mirror

    def input(self, images: torch.Tensor) -> torch.Tensor:
        return model_input(images, self.device, self.memory_format)

    def with_module(self, module: nn.Module) -> PlacedModel:
        return dataclasses.replace(self, module=module)

    def eval_logits(self, images: torch.Tensor) -> torch.Tensor:
        """Logits of a loader batch, the model in eval mode."""
        x = self.input(images)
        logits = self.module(x)
        if self.tta:  # the horizontal flip is the one augmentation training used on every image
            logits = (logits + self.module(x.flip(3))) / 2
        return logits


def model_input(images: torch.Tensor, device: torch.device, memory_format: torch.memory_format) -> torch.Tensor:
    """A loader batch as the model takes it. The loaders give uint8 pixels, which cross to the
    device as they are and become normalised floats there, in the model's memory format (the
    layout changes while the pixels are still one byte each). A batch that is floating point
    already (synthetic input, tests) is taken as normalised."""
    images = images.to(device, non_blocking=True, memory_format=memory_format)
    return normalize(images) if images.dtype == torch.uint8 else images


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
    # Without native bf16 instructions the CPU emulates it, slower than fp32; so do torch's and oneDNN's
    # kernels held below AVX512 (ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2: 3.5x slower measured).
    cpu, isa = torch.cpu, os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").upper()
    native = getattr(cpu, "_is_avx512_bf16_supported", lambda: False)() or getattr(cpu, "_is_amx_tile_supported", lambda: False)()
    capped = isa.startswith(("SSE", "AVX2")) or isa in ("AVX", "AVX512_CORE", "AVX512_CORE_VNNI")
    native = native and torch.backends.cpu.get_cpu_capability() == "AVX512" and not capped
    return torch.bfloat16 if device.type == "cpu" and native else None


def build_model(args: argparse.Namespace, num_classes: int, ctx: DistContext) -> nn.Module:
    """The model with its initial weights, seeded (the same on every rank) or --weights, on this
    rank's device in the memory format asked for."""
    torch.manual_seed(args.seed)  # the same initial weights in every rerun (DDP then copies rank 0's to all)
    model = model_for(args, num_classes)
    if args.weights:
        load_weights(model, args.weights, ctx.print0, args.model)
    if args.freeze_layers:
        freeze_backbone(model)
    placed = place_model(model, args, ctx.device)
    precision = "fp32" if placed.amp_dtype is None else str(placed.amp_dtype).removeprefix("torch.") + " autocast"
    graph = ", training step: a CUDA graph" if wanted(args, ctx.device) else ""
    ctx.print0(f"precision: {precision}, memory format: {'channels_last' if args.channels_last else 'NCHW'}{graph}")
    return model


def place_model(model: nn.Module, args: argparse.Namespace, device: torch.device) -> PlacedModel:
    """Move the model to the device in the memory format and precision that `args` ask for."""
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
    model.to(device, memory_format=memory_format)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # fixed input sizes: autotuned kernels pay off from step 2
    if wanted(args, device):
        use_side_stream(device)  # before the DDP wrap: the graph of the step is captured on it
    return placed(model, args, device)


def placed(model: nn.Module, args: argparse.Namespace, device: torch.device) -> PlacedModel:
    """How `args` feed batches to `model` (already on `device`)."""
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
    return PlacedModel(model, device, memory_format, autocast_dtype(args.amp, device), args.tta)


def build_optimizer(model: nn.Module, args: argparse.Namespace, device: torch.device
                    ) -> tuple[torch.optim.Optimizer, torch.amp.GradScaler, WeightAverage | None]:
    """SGD with Nesterov momentum over `model`'s parameters (built after the DDP wrap and any
    layer swap, over the parameters the model has then); the loss scaler beside it; and under
    --ema the average of the weights it steps (train_one_epoch updates it after each step)."""
    # Weight decay on BatchNorm scales and biases only fights the normalisation.
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.ndim > 1 else no_decay).append(param)
    groups = [
        {"params": decay, "weight_decay": args.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    # train_one_epoch sets the learning rate at every step. The fused kernel updates all
    # parameters in one pass; it exists for CPU and CUDA tensors.
    optimizer = torch.optim.SGD(groups, lr=0.0, momentum=args.momentum, nesterov=args.momentum > 0, fused=True)
    if args.momentum > 0:
        # Zero momentum to start from (then the first step's buffer is its gradient, as SGD's own
        # first step makes it): fused SGD makes the buffers with empty_like at its first step and
        # skips that step whole when fp16 gradients overflowed, leaving them uninitialised.
        for param in decay + no_decay:
            optimizer.state[param]["momentum_buffer"] = torch.zeros_like(param, memory_format=torch.preserve_format)
    # Loss scaling keeps small fp16 gradients from flushing to zero; bf16 has fp32's range.
    scaler = torch.amp.GradScaler(device.type, enabled=autocast_dtype(args.amp, device) == torch.float16)
    return optimizer, scaler, WeightAverage(model, args.ema_decay) if args.ema else None


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        if isinstance(group["lr"], torch.Tensor) and group["lr"].is_cuda:
            group["lr"].fill_(lr)  # --cuda-graph: the graph reads it there
        else:
            group["lr"] = lr


def never() -> bool:
    return False


def train_one_epoch(model: nn.Module, criterion: nn.Module, optimizer: torch.optim.Optimizer,
                    scaler: torch.amp.GradScaler, loader: Iterable, epoch: int, progress: Progress,
                    args: argparse.Namespace, ctx: DistContext, ema: WeightAverage | None = None,
                    stop_requested: Callable[[], bool] = never) -> dict[str, Any]:
    """One pass over this rank's shard of the training images (the rest of it, for the epoch a
    resumed run stopped in: `progress` says where): per batch the forward pass, `loss.backward()`
    and, on the batch that closes an optimizer step (--accum-steps), the step itself.

    Collectives: DDP's all-reduce of the gradients in each closing backward(); at least every
    CHECK_EVERY steps an all_reduce(MIN) of three numbers (a non-finite loss anywhere ends the run, a
    `stop_requested` anywhere stops every rank after this step, the slowest rank's step); and
    one all_reduce(SUM) of the epoch's sums at its end. The result: the epoch's loss and
    accuracy over all ranks, and its seconds, for the record."""
    started = clock()
    steps_done = progress.steps_in_epoch
    steps = Accumulation(args.accum_steps, steps_done + len(loader), first=steps_done)
    steps_per_epoch = math.ceil(steps.batches / args.accum_steps)
    steps_before = (epoch - 1) * steps_per_epoch  # the earlier epochs' optimizer steps
    schedule = build_schedule(args, peak_lr(args, ctx), steps_per_epoch, progress.budget_epochs)
    feed = placed(unwrapped(model), args, ctx.device)
    mix = build_mix(args, unwrapped(model))  # --mixup-alpha, --cutmix-alpha: else None
    graph = graphed_step(optimizer, model, args, ctx.device)  # --cuda-graph: else None
    set_train_mode(model)
    tally = EpochTally(ctx, progress.epoch_sums)
    # Bars on rank 0 only, and only on a terminal (disable=None): logs stay free of them.
    bar = tqdm(loader, desc=f"epoch {epoch}/{progress.budget_epochs or most_epochs(args)}", disable=None if ctx.is_main else True, leave=False,
               dynamic_ncols=True)
    stopped = None
    for batch, (images, labels) in enumerate(tally.waited(bar), start=steps_done):
        at = steps.place(batch)
        step = steps_before + at.step_in_epoch
        images, labels = feed.input(images), labels.to(ctx.device, non_blocking=True)
        set_lr(optimizer, schedule(step))
        inputs, targets = mix(images, labels, steps_before * args.accum_steps + batch) if mix else (images, labels)
        # On a GPU by default (--cuda-graph auto): the step below, DDP's all-reduce and the optimizer's step
        # included, replayed as one CUDA graph; None: it runs below (a warm-up step, an epoch's last batch).
        replayed = graph.replay(inputs, targets, model, criterion, optimizer, scaler, feed.amp_dtype,
                                args.clip_grad_norm) if graph else None
        if replayed:
            loss, logits = replayed
        else:
            # DDP all-reduces the gradients during the backward pass of the batch that closes an
            # optimizer step; the batches before it (--accum-steps) add theirs up locally (no_sync).
            with contextlib.nullcontext() if at.closes or not ctx.distributed else model.no_sync():
                with torch.autocast(ctx.device.type, dtype=feed.amp_dtype, enabled=feed.amp_dtype is not None):
                    logits = model(inputs)
                    loss = criterion(logits, targets)
                scaler.scale(loss / at.batches_in_step).backward()  # the step takes the mean of its batches
            if at.closes:
                if args.clip_grad_norm is not None:
                    scaler.unscale_(optimizer)  # clip the true gradient, not the fp16-scaled one
                    nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad_norm)
                scaler.step(optimizer)  # optimizer.step(), unless fp16 gradients overflowed
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
        if at.closes and ema is not None:
            ema.update(step + 1)
        tally.add(loss.detach(), logits, labels, batch)
        if at.closes and at.look:
            stop, batch_seconds = tally.look(  # all_reduce(MIN): a bad loss, a stop asked, the slowest step
                optimizer, epoch, batch, steps.batches, bar, stop_requested)
            if stop:
                stopped = batch + 1
                break
            steps.looked(at.step_in_epoch, batch_seconds * args.accum_steps)
    bar.close()
    totals = all_reduce_sum(tally.local_sums(), ctx)  # the epoch's one all-reduce
    return {**tally.metrics(totals), "seconds": clock() - started, "stopped_after": stopped, **ddp_timers(model, bool(graph)),
            "lr": schedule(epoch * steps_per_epoch)}  # where the epoch left the schedule


@dataclasses.dataclass(frozen=True)
class StepPlace:
    """Where a batch of an epoch falls among its optimizer steps."""

    step_in_epoch: int  # the epoch's optimizer steps before this batch's
    closes: bool  # the last batch of its optimizer step: it all-reduces, and the step follows it
    batches_in_step: int  # --accum-steps, or fewer in an epoch's last step
    look: bool  # the tally is looked at after this batch (EpochTally.look)


class Accumulation:
    """--accum-steps' arithmetic over one epoch of `batches` batches: every `k` batches make
    one optimizer step, and the epoch's last step takes the batches that are left. The tally is
    looked at after the first step this pass makes (from batch `first`: a SIGTERM that came
    while the model evaluated or rank 0 saved is then acted on at once), then every
    CHECK_EVERY-th step, or more often where steps take long (`looked`), and after the last."""

    def __init__(self, k: int, batches: int, first: int = 0):
        self.k, self.batches = k, batches
        self.next_look = first // k
        self.every = CHECK_EVERY

    def place(self, batch: int) -> StepPlace:
        k, in_epoch = self.k, batch // self.k
        closes = (batch + 1) % k == 0 or batch + 1 == self.batches
        look = in_epoch >= self.next_look or batch + 1 == self.batches
        return StepPlace(in_epoch, closes, min(k, self.batches - in_epoch * k), look)

    def looked(self, step: int, step_seconds: float) -> None:
        """After the look at step `step`: the next at the next multiple of the interval, which is
        CHECK_EVERY, or the steps that take LOOK_SECONDS at `step_seconds` (the slowest rank's,
        from the look's all-reduce: the same on every rank, so all look at the same steps)."""
        self.every = max(1, min(CHECK_EVERY, int(LOOK_SECONDS / max(step_seconds, 1e-9))))
        self.next_look = ((step + 1) // self.every + 1) * self.every - 1


class EpochTally:
    """An epoch's loss and accuracy as running sums on the device (loss x images, correct),
    the images counted on the host, the first batch whose loss was not finite, and the
    seconds the loop stood waiting for data. Nothing here makes the host wait for the device
    but `look` (one small collective) and `metrics`."""

    def __init__(self, ctx: DistContext, sums_so_far: Sequence[float]):
        self.ctx = ctx
        self.before = sums_so_far[2]  # images of a resumed epoch's part before the stop
        # What earlier steps summed to is counted once, on rank 0.
        self.sums = torch.tensor(sums_so_far if ctx.is_main else (0.0, 0.0, 0.0), dtype=torch.float64,
                                 device=ctx.device)
        self.images = 0
        self.first_bad = torch.full((), NO_BAD_STEP, dtype=torch.int64, device=ctx.device)
        self.data_wait = 0.0
        self.batches_seen = 0
        self.started = time.perf_counter()  # the pace of the steps sets how often the loop looks

    def waited(self, batches: Iterable) -> Iterator:
        """`batches`, timing how long each was waited for: on a GPU, time it may have starved
        (the host otherwise runs ahead of the device). Measured on the host: no sync."""
        asked = time.perf_counter()
        for item in batches:
            self.data_wait += time.perf_counter() - asked
            yield item
            asked = time.perf_counter()

    def add(self, loss: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor, batch: int) -> None:
        n = labels.numel()  # known on the host: a device tensor every step would be a copy to the GPU
        self.sums[:2] += torch.stack([loss.double() * n, (logits.argmax(1) == labels).sum().double()])
        self.images += n
        self.batches_seen += 1
        # Remember the first non-finite batch on the device; no sync here.
        self.first_bad = torch.where(~torch.isfinite(loss) & (self.first_bad == NO_BAD_STEP), batch + 1, self.first_bad)

    def look(self, optimizer: torch.optim.Optimizer, epoch: int, batch: int, batches: int, bar: tqdm,
             stop_requested: Callable[[], bool]) -> tuple[bool, float]:
        """One small all_reduce(MIN): a non-finite loss on any rank ends the run
        (TrainingDiverged). Returns whether a stop was asked of any rank (so that every rank
        stops here), and the slowest rank's seconds per batch in this pass so far."""
        stop = -1 if stop_requested() else 0
        micros = int(1e6 * (time.perf_counter() - self.started) / max(1, self.batches_seen))
        looked = torch.stack([self.first_bad, torch.tensor(stop, device=self.ctx.device),
                              torch.tensor(-micros, device=self.ctx.device)])
        bad, stopping, slowest = all_reduce_min(looked, self.ctx).tolist()
        if bad != NO_BAD_STEP:
            raise TrainingDiverged(f"the loss became NaN or infinite at epoch {epoch}, step {bad} of {batches}: "
                                   "lower --lr, or check the data")
        if stopping < 0:
            return True, -slowest / 1e6
        if self.ctx.is_main:
            loss_sum, correct, before = self.sums.tolist()
            bar.set_postfix(loss=f"{loss_sum / (before + self.images):.4f}",
                            acc=f"{correct / (before + self.images):.3f}",
                            lr=f"{optimizer.param_groups[0]['lr']:.2e}", refresh=False)
        return False, -slowest / 1e6

    def local_sums(self) -> torch.Tensor:
        """This rank's (loss x images, correct, images, seconds waiting for data), to be summed over ranks."""
        self.sums[2] += self.images
        return torch.cat([self.sums, self.sums.new_tensor([self.data_wait])])

    def metrics(self, totals: torch.Tensor) -> dict[str, Any]:
        """The epoch's metrics from `local_sums` summed over all ranks. epoch_images: what the
        whole epoch trained on; train_images: what this call trained on (a resumed epoch's
        rest), for the images/s figure; sums: the running sums, which a stopped epoch's
        position holds."""
        loss_sum, correct, count, waits = totals.tolist()
        return {"train_loss": loss_sum / count, "train_acc": correct / count, "epoch_images": int(count),
                "train_images": int(count - self.before), "data_wait_seconds": waits / self.ctx.world_size,
                "sums": (loss_sum, correct, count)}


# This rank's (logits, labels, dataset indices) batches of one pass over the validation shard.
Outputs = list[tuple[torch.Tensor, torch.Tensor, list[int]]]


def predictions(placed: PlacedModel, loader: Iterable) -> Iterator[tuple[torch.Tensor, torch.Tensor, list[int]]]:
    """(logits, labels, dataset indices) of each batch of this rank's shard, the model in eval
    mode and in fp32. The caller disables autograd."""
    placed.module.eval()
    indices = iter(loader.sampler)  # the order the loader draws its batches in
    for images, labels in loader:
        labels = labels.to(placed.device, non_blocking=True)
        yield placed.eval_logits(images), labels, [next(indices) for _ in range(len(labels))]


@torch.no_grad()
def validation_outputs(placed: PlacedModel, loader: Iterable) -> Outputs:
    """Every batch's predictions, kept: an epoch's metrics are computed from them, and the best
    epoch's become the final report without a second pass (a few numbers per image)."""
    return list(predictions(placed, loader))


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """An epoch's evaluation: the metrics (the weight average's as ema_*), which weights
    scored higher ("model" or "ema"), their outputs, their recomputed BatchNorm statistics
    (--bn-recalibrate; else None), and the seconds it took."""

    val: dict[str, float]
    better: str
    outputs: Outputs
    evaluated_bn: dict[str, torch.Tensor] | None
    seconds: float = 0.0

    @property
    def better_acc(self) -> float:
        """The better weights' accuracy (the model's, or --ema's average's if higher): the one
        best.pth is chosen by."""
        return max(self.val["val_acc"], self.val.get("ema_val_acc", 0.0))


def evaluate_epoch(model: nn.Module, loader: Iterable, args: argparse.Namespace, ctx: DistContext,
                   ema: WeightAverage | None = None,
                   recalibrate: Callable[[PlacedModel, DistContext], PlacedModel] | None = None) -> Evaluation:
    """The exact validation metrics of `model` (unwrapped: no DDP, not compiled), and of its
    weight average when there is one, each prepared by `recalibrate` when asked; which of the
    two scored higher, and its outputs. Every rank evaluates its own shard, with rank 0's
    BatchNorm statistics (running means and variances): without --sync-bn each rank's follow its
    own batches; with rank 0's, every rank evaluates, and trains on from, the weights rank 0
    saves, and the accuracy is the checkpoint's at any world size. Collectives, per model: a
    broadcast per dtype of its buffers, then one all_reduce(SUM) of the shard's sums."""
    started = clock()
    modules = {"model": model, **({"ema": ema.module} if ema else {})}
    done = {}
    for module in modules.values():
        broadcast_buffers(module, ctx)  # broadcast: rank 0's BatchNorm statistics
    for name, module in modules.items():
        feed = placed(module, args, ctx.device)
        if recalibrate:
            feed = recalibrate(feed, ctx)  # broadcast: rank 0's recomputed statistics
        outputs = validation_outputs(feed, loader)
        done[name] = (metrics_of(all_reduce_sum(validation_sums(outputs, ctx.device), ctx)), outputs, feed.module)
    val = dict(done["model"][0])
    if "ema" in done:
        val.update({f"ema_{k}": v for k, v in done["ema"][0].items()})
    better = "ema" if "ema" in done and done["ema"][0]["val_acc"] > val["val_acc"] else "model"
    _, outputs, module = done[better]
    return Evaluation(val, better, outputs, batch_norm_statistics(module) if recalibrate else None,
                      clock() - started)


def evaluate(placed: PlacedModel, loader: Iterable, ctx: DistContext) -> dict[str, float]:
    """Exact accuracy and mean loss over the whole validation split."""
    return validation_metrics(validation_outputs(placed, loader), ctx)  # all_reduce


def validation_metrics(outputs: Outputs, ctx: DistContext) -> dict[str, float]:
    """Exact accuracy and mean loss over the whole validation split, from this rank's outputs."""
    return metrics_of(all_reduce_sum(validation_sums(outputs, ctx.device), ctx))


@torch.no_grad()
def validation_sums(outputs: Outputs, device: torch.device) -> torch.Tensor:
    """(loss sum, correct, images) of this rank's shard. The shards are disjoint and unpadded,
    so summed over the ranks every image counts exactly once. The logits are fp32 (evaluation
    runs without autocast): bf16 rounding could differ with the batch composition, which
    changes with the world size, and flip a borderline image."""
    sums = torch.zeros(3, dtype=torch.float64, device=device)
    images_seen = 0
    criterion = nn.CrossEntropyLoss(reduction="sum")
    for logits, labels, _ in outputs:
        sums[:2] += torch.stack([criterion(logits, labels).double(), (logits.argmax(1) == labels).sum().double()])
        images_seen += labels.numel()
    sums[2] = images_seen
    return sums


def metrics_of(sums: torch.Tensor) -> dict[str, float]:
    """Mean loss and accuracy from (loss sum, correct, images) summed over all ranks."""
    loss_sum, correct, count = sums.tolist()
    return {"val_loss": loss_sum / count, "val_acc": correct / count, "val_correct": int(correct), "val_total": int(count)}
