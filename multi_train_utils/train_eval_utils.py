"""Training and evaluation: the model built and put on its device, the optimizer and what a
step uses, one training epoch (forward, backward, optimizer step), and exact evaluation. Each
launcher strings them together in its own epoch loop."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch
from torch import nn
from tqdm import tqdm

from model import freeze_backbone, model_for, set_train_mode
from multi_train_utils.checkpoint import load_weights
from multi_train_utils.distributed_utils import DistContext, all_reduce_min, all_reduce_sum, broadcast_buffers
from multi_train_utils.ema import WeightAverage
from multi_train_utils.mixing import BatchMix, build_mix
from multi_train_utils.schedule import Schedule, build_schedule, global_batch, peak_lr
from my_dataset import normalize
from utils import TrainingDiverged

# Steps between looks at the loss on the host: each look is one small collective and one
# host sync, so the loop never waits on the device at every step.
CHECK_EVERY = 20
NO_BAD_STEP = 2**62


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
    # Without native bf16 instructions the CPU emulates it, slower than fp32.
    cpu = torch.cpu
    native = getattr(cpu, "_is_avx512_bf16_supported", lambda: False)() or getattr(cpu, "_is_amx_tile_supported", lambda: False)()
    return torch.bfloat16 if device.type == "cpu" and native else None


def build_model(args: argparse.Namespace, num_classes: int, device: torch.device,
                say: Callable[[str], None] = print) -> PlacedModel:
    """The model with its initial weights (seeded, or --weights), on the device. `say` takes
    its lines (the launchers keep them to print in order: this runs beside the data's start-up)."""
    torch.manual_seed(args.seed)  # the same initial weights in every rerun (DDP then copies rank 0's to all)
    model = model_for(args, num_classes)
    if args.weights:
        load_weights(model, args.weights, say, args.model)
    if args.freeze_layers:
        freeze_backbone(model)
    placed = place_model(model, args, device)
    precision = "fp32" if placed.amp_dtype is None else str(placed.amp_dtype).removeprefix("torch.") + " autocast"
    say(f"precision: {precision}, memory format: {'channels_last' if args.channels_last else 'NCHW'}")
    return placed


def place_model(model: nn.Module, args: argparse.Namespace, device: torch.device) -> PlacedModel:
    """Move the model to the device in the memory format and precision that `args` ask for."""
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
    model.to(device, memory_format=memory_format)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # fixed input sizes: autotuned kernels pay off from step 2
    return PlacedModel(model, device, memory_format, autocast_dtype(args.amp, device), args.tta)


def build_optimizer(model: nn.Module, args: argparse.Namespace) -> torch.optim.Optimizer:
    # Weight decay on BatchNorm scales and biases only fights the normalisation.
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.ndim > 1 else no_decay).append(param)
    groups = [
        {"params": decay, "weight_decay": args.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    # The loop sets the learning rate at every step. The fused kernel updates all parameters
    # in one pass; it exists for CPU and CUDA tensors.
    return torch.optim.SGD(groups, lr=0.0, momentum=args.momentum, nesterov=args.momentum > 0, fused=True)


class StoppedInEpoch(Exception):
    """Every rank stopped at the same step because one was asked to (SIGTERM)."""

    def __init__(self, steps_done: int, sums: list[float]):
        super().__init__(f"stopped after step {steps_done}")
        self.steps_done = steps_done
        self.sums = sums  # loss sum, correct, images over all ranks so far


def never() -> bool:
    return False


@dataclasses.dataclass(frozen=True)
class Training:
    """Everything a training step uses, assembled once by `build_training`."""

    placed: PlacedModel
    model: nn.Module  # as the loop calls it: in DistributedDataParallel in a job, compiled where asked
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    criterion: nn.Module
    schedule: Schedule
    steps_per_epoch: int  # optimizer steps
    global_batch: int  # images per optimizer step, over all processes and accumulated batches
    mix: BatchMix | None = None  # MixUp/CutMix
    clip_grad_norm: float | None = None
    ema: WeightAverage | None = None
    accum_steps: int = 1  # batches per optimizer step
    stop_requested: Callable[[], bool] = never  # read every CHECK_EVERY steps; all ranks then stop

    def until(self, stop_requested: Callable[[], bool]) -> Training:
        """The same training, stopping every rank at the step after `stop_requested` turns true on any."""
        return dataclasses.replace(self, stop_requested=stop_requested)


def build_training(placed: PlacedModel, args: argparse.Namespace, ctx: DistContext, batches_per_epoch: int,
                   model: nn.Module | None = None) -> Training:
    """The optimizer (SGD with Nesterov momentum), the learning-rate schedule, the loss and its
    scaler, and what was asked for beside them (MixUp/CutMix, clipping, the weight average),
    as every launcher and the benchmarks train. `model`: what the loop calls, the model in
    DistributedDataParallel in a job (the launcher wraps it); `placed.module` alone otherwise.
    `batches_per_epoch`: the training loader's length in this process."""
    if model is None:
        if ctx.distributed:
            raise ValueError("in a process group the loop calls the model in DistributedDataParallel: pass it")
        model = placed.module
    if args.compile:
        model = torch.compile(model)  # checkpoints and evaluation use the uncompiled placed.module
    # Loss scaling keeps small fp16 gradients from flushing to zero; bf16 has fp32's range.
    scaler = torch.amp.GradScaler(ctx.device.type, enabled=placed.amp_dtype == torch.float16)
    steps_per_epoch = math.ceil(batches_per_epoch / args.accum_steps)
    return Training(placed, model, build_optimizer(placed.module, args), scaler,
                    nn.CrossEntropyLoss(label_smoothing=args.label_smoothing),
                    build_schedule(args, peak_lr(args, ctx), steps_per_epoch), steps_per_epoch,
                    global_batch(args, ctx), build_mix(args, placed.module),
                    args.clip_grad_norm, WeightAverage(placed.module, args.ema_decay) if args.ema else None,
                    args.accum_steps)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def train_one_epoch(training: Training, loader: Iterable, ctx: DistContext, epoch: int, epochs: int,
                    steps_done: int = 0, sums_so_far: Sequence[float] = (0.0, 0.0, 0.0)) -> dict[str, float]:
    """One pass over this rank's shard, or its rest after `steps_done` batches that summed to
    `sums_so_far` over all ranks: per batch forward, backward and, on the batch that closes an
    optimizer step, the step itself; the loss and accuracy tallied on the device, looked at now
    and then (Accumulation, EpochTally.look), and summed over the ranks once, at the end."""
    model, placed = training.model, training.placed
    set_train_mode(model)
    tally = EpochTally(ctx, sums_so_far)
    steps = Accumulation(training.accum_steps, steps_done + len(loader), (epoch - 1) * training.steps_per_epoch,
                         first=steps_done)
    # Bars on rank 0 only, and only on a terminal (disable=None): logs stay free of them.
    bar = tqdm(loader, desc=f"epoch {epoch}/{epochs}", disable=None if ctx.is_main else True, leave=False,
               dynamic_ncols=True)
    for batch, (images, labels) in enumerate(tally.waited(bar), start=steps_done):
        at = steps.place(batch)
        images, labels = placed.input(images), labels.to(ctx.device, non_blocking=True)
        set_lr(training.optimizer, training.schedule(at.optimizer_step))
        inputs, targets = training.mix(images, labels, at.batch_in_run) if training.mix else (images, labels)
        # DDP all-reduces the gradients during the backward pass of the batch that closes an
        # optimizer step; the batches before it (--accum-steps) add theirs up locally (no_sync).
        with contextlib.nullcontext() if at.closes or not ctx.distributed else model.no_sync():
            with torch.autocast(ctx.device.type, dtype=placed.amp_dtype, enabled=placed.amp_dtype is not None):
                logits = model(inputs)
                loss = training.criterion(logits, targets)
            training.scaler.scale(loss / at.batches_in_step).backward()  # the step takes the mean of its batches
        if at.closes:
            apply_gradients(training, at.optimizer_step + 1)
        tally.add(loss.detach(), logits, labels, batch)
        if at.look:
            tally.look(training, epoch, batch, steps.batches, bar)
    bar.close()
    return tally.metrics(all_reduce_sum(tally.local_sums(), ctx))  # the epoch's one all-reduce


@dataclasses.dataclass(frozen=True)
class StepPlace:
    """Where a batch of an epoch falls among the run's optimizer steps."""

    optimizer_step: int  # the run's optimizer steps before this batch's: the schedule's step
    closes: bool  # the last batch of its optimizer step: it all-reduces, and the step follows it
    batches_in_step: int  # --accum-steps, or fewer in an epoch's last step
    batch_in_run: int  # the run's batches before this one: MixUp's and CutMix's draws follow it
    look: bool  # the tally is looked at after this batch (EpochTally.look)


class Accumulation:
    """--accum-steps' arithmetic over one epoch of `batches` batches: every `k` batches make
    one optimizer step, and the epoch's last step takes the batches that are left. The tally is
    looked at after every CHECK_EVERY-th step, the last, and the first this pass makes (from
    batch `first`): a SIGTERM that came while the model evaluated or rank 0 saved is then acted
    on at once, not CHECK_EVERY steps into the epoch."""

    def __init__(self, k: int, batches: int, steps_before: int, first: int = 0):
        self.k, self.batches, self.steps_before = k, batches, steps_before  # steps_before: the earlier epochs' steps
        self.first_step = first // k

    def place(self, batch: int) -> StepPlace:
        k, in_epoch = self.k, batch // self.k
        closes = (batch + 1) % k == 0 or batch + 1 == self.batches
        look = in_epoch == self.first_step or (in_epoch + 1) % CHECK_EVERY == 0 or batch + 1 == self.batches
        return StepPlace(self.steps_before + in_epoch, closes, min(k, self.batches - in_epoch * k),
                         self.steps_before * k + batch, closes and look)


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
        # Remember the first non-finite batch on the device; no sync here.
        self.first_bad = torch.where(~torch.isfinite(loss) & (self.first_bad == NO_BAD_STEP), batch + 1, self.first_bad)

    def look(self, training: Training, epoch: int, batch: int, batches: int, bar: tqdm) -> None:
        """One small collective: a non-finite loss on any rank ends the run (TrainingDiverged),
        and a stop asked of any rank stops every rank here (StoppedInEpoch)."""
        stop = torch.tensor(-1 if training.stop_requested() else 0, device=self.ctx.device)
        bad, stopping = all_reduce_min(torch.stack([self.first_bad, stop]), self.ctx).tolist()
        if bad != NO_BAD_STEP:
            raise TrainingDiverged(f"the loss became NaN or infinite at epoch {epoch}, step {bad} of {batches}: "
                                   "lower --lr, or check the data")
        if stopping < 0:
            self.sums[2] += self.images
            raise StoppedInEpoch(batch + 1, all_reduce_sum(self.sums, self.ctx).tolist())
        if self.ctx.is_main:
            loss_sum, correct, before = self.sums.tolist()
            bar.set_postfix(loss=f"{loss_sum / (before + self.images):.4f}",
                            acc=f"{correct / (before + self.images):.3f}",
                            lr=f"{training.optimizer.param_groups[0]['lr']:.2e}", refresh=False)

    def local_sums(self) -> torch.Tensor:
        """This rank's (loss x images, correct, images, seconds waiting for data), to be summed over ranks."""
        self.sums[2] += self.images
        return torch.cat([self.sums, self.sums.new_tensor([self.data_wait])])

    def metrics(self, totals: torch.Tensor) -> dict[str, float]:
        """The epoch's metrics from `local_sums` summed over all ranks. epoch_images: what the
        whole epoch trained on; train_images: what this call trained on (a resumed epoch's
        rest), for the images/s figure."""
        loss_sum, correct, count, waits = totals.tolist()
        return {"train_loss": loss_sum / count, "train_acc": correct / count, "epoch_images": int(count),
                "train_images": int(count - self.before), "data_wait_seconds": waits / self.ctx.world_size}


def apply_gradients(training: Training, optimizer_steps: int) -> None:
    """The optimizer step on the accumulated gradients (clipped when asked), then the weight
    average's; `optimizer_steps`: how many the run has taken, this one included."""
    optimizer, scaler = training.optimizer, training.scaler
    if training.clip_grad_norm is not None:
        scaler.unscale_(optimizer)  # clip the true gradient, not the fp16-scaled one
        nn.utils.clip_grad_norm_(training.placed.module.parameters(), training.clip_grad_norm)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    if training.ema is not None:
        training.ema.update(optimizer_steps)


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


def batch_norms(module: nn.Module) -> list[nn.modules.batchnorm._BatchNorm]:
    return [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def batch_norm_statistics(module: nn.Module) -> dict[str, torch.Tensor]:
    """The BatchNorm buffers of `module` (running mean, variance and batch count), by state-dict key."""
    names = {id(m): name for name, m in module.named_modules()}
    return {f"{names[id(m)]}.{key}".lstrip("."): value.detach().clone()
            for m in batch_norms(module) for key, value in m.named_buffers(recurse=False)}


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """An epoch's evaluation: the metrics (the weight average's as ema_*), which weights
    scored higher ("model" or "ema"), their outputs, and their recomputed BatchNorm statistics
    (--bn-recalibrate; else None)."""

    val: dict[str, float]
    better: str
    outputs: Outputs
    evaluated_bn: dict[str, torch.Tensor] | None

    @property
    def acc(self) -> float:
        """The better weights' accuracy, the one best.pth is chosen by."""
        return max(self.val["val_acc"], self.val.get("ema_val_acc", 0.0))


def evaluate_epoch(training: Training, val_pass: Callable[[], Iterable], ctx: DistContext,
                   recalibrate: Callable[[PlacedModel, DistContext], PlacedModel] | None = None) -> Evaluation:
    """The model's exact validation metrics, and its weight average's when there is one (each
    over a pass that `val_pass` gives), each prepared by `recalibrate` when asked. Every rank
    evaluates its own shard; the sums then go over the ranks in one all-reduce per model."""
    modules = {"model": training.placed.module, **({"ema": training.ema.module} if training.ema else {})}
    done = {}
    for name, module in modules.items():
        broadcast_buffers(module, ctx)  # rank 0's BatchNorm statistics: every rank evaluates the weights it saves
        placed = training.placed.with_module(module)
        if recalibrate:
            placed = recalibrate(placed, ctx)
        outputs = validation_outputs(placed, val_pass())
        done[name] = (metrics_of(all_reduce_sum(validation_sums(outputs, ctx.device), ctx)), outputs, placed.module)
    val = dict(done["model"][0])
    if "ema" in done:
        val.update({f"ema_{k}": v for k, v in done["ema"][0].items()})
    better = "ema" if "ema" in done and done["ema"][0]["val_acc"] > val["val_acc"] else "model"
    _, outputs, module = done[better]
    return Evaluation(val, better, outputs, batch_norm_statistics(module) if recalibrate else None)


def evaluate(placed: PlacedModel, loader: Iterable, ctx: DistContext) -> dict[str, float]:
    """Exact accuracy and mean loss over the whole validation split."""
    return validation_metrics(validation_outputs(placed, loader), ctx)


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
