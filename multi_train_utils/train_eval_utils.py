"""Training and evaluation: the model on its device, the optimizer and its learning-rate
schedule, one training epoch, and exact evaluation. The run that strings them together is
multi_train_utils/run.py."""
from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torchvision.transforms import v2
from tqdm import tqdm

from model import classifier, convert_sync_batchnorm, set_train_mode
from multi_train_utils.budget import planned_epochs
from multi_train_utils.distributed_utils import DistContext, all_reduce_min, all_reduce_sum, broadcast_buffers
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


def place_model(model: nn.Module, args: argparse.Namespace, device: torch.device) -> PlacedModel:
    """Move the model to the device in the memory format and precision that `args` ask for."""
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
    model.to(device, memory_format=memory_format)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # fixed input sizes: autotuned kernels pay off from step 2
    return PlacedModel(model, device, memory_format, autocast_dtype(args.amp, device), args.tta)


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Linear warm-up to the peak, held there until `decay_from` (under a budget, the end of
    epoch 1: the decay's length is not known before), then a decay to `final_fraction` of the
    peak by the last step: a cosine, or a straight line. The learning rate is a function of the
    step alone: a resumed run at any world size computes it afresh."""

    peak: float
    total_steps: int
    warmup_steps: int
    final_fraction: float
    decay: str = "cosine"
    decay_from: int = 0

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.peak * (step + 1) / (self.warmup_steps + 1)
        start = max(self.warmup_steps, self.decay_from)
        progress = min(1.0, max(0, step - start) / max(1, self.total_steps - start))
        falls = 1 - progress if self.decay == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
        return self.peak * (self.final_fraction + (1 - self.final_fraction) * falls)


def build_schedule(args: argparse.Namespace, peak: float, steps_per_epoch: int, epochs: int | None = None) -> Schedule:
    """`epochs`: the count --time-budget fixed after epoch 1 (default --epochs, or 30). Epoch 1
    runs before that count is known, so under a budget the decay starts at epoch 2 at the
    earliest (a shorter warm-up holds the peak until then): epoch 1 is the same whatever the
    count."""
    total = max(1, (epochs or planned_epochs(args)) * steps_per_epoch)
    warmup = round(args.warmup_epochs * steps_per_epoch)
    if args.time_budget is None:
        return Schedule(peak, total, min(total - 1, warmup), args.lrf, args.lr_decay)
    return Schedule(peak, total, warmup, args.lrf, args.lr_decay, decay_from=steps_per_epoch)


def global_batch(args: argparse.Namespace, ctx: DistContext) -> int:
    """Images per optimizer step: the batch of every process, times the batches accumulated."""
    return args.batch_size * ctx.world_size * args.accum_steps


def peak_lr(args: argparse.Namespace, ctx: DistContext) -> float:
    """The linear scaling rule: `--lr` is per 256 images of global batch."""
    return args.lr * global_batch(args, ctx) / 256


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


class WeightAverage:
    """An exponential moving average of a model's weights and BatchNorm statistics, kept in
    fp32 (autocast leaves the parameters in fp32) on the model's device.

    The decay warms up as (1 + t) / (10 + t) after t optimizer steps (TensorFlow's
    ExponentialMovingAverage with num_updates): a fixed decay would keep remembering the random
    initial weights long after training has left them.
    """

    def __init__(self, module: nn.Module, decay: float):
        self.module = copy.deepcopy(module).requires_grad_(False)
        self.decay = decay
        mine, theirs = self.module.state_dict(), module.state_dict()
        self.pairs = [(mine[k], theirs[k]) for k in mine]  # views of the tensors: updated in place

    @torch.no_grad()
    def update(self, steps: int) -> None:
        """Move towards the model's current weights, `steps` optimizer steps into the run."""
        decay = min(self.decay, (1 + steps) / (10 + steps))
        for mine, theirs in self.pairs:
            if mine.is_floating_point():
                mine.lerp_(theirs, 1 - decay)
            else:
                mine.copy_(theirs)  # BatchNorm's num_batches_tracked


def build_mix(args: argparse.Namespace, model: nn.Module) -> Callable | None:
    """MixUp and/or CutMix as torchvision.transforms.v2 implements them (one of the two per
    batch when both are asked for, as torchvision's references do), or None."""
    asked = [(mix, alpha) for mix, alpha in ((v2.MixUp, args.mixup_alpha), (v2.CutMix, args.cutmix_alpha)) if alpha > 0]
    if not asked:
        return None
    num_classes = classifier(model)[1].out_features
    mixes = [mix(alpha=alpha, num_classes=num_classes) for mix, alpha in asked]
    return mixes[0] if len(mixes) == 1 else v2.RandomChoice(mixes)


def mixed(training: Training, images: torch.Tensor, labels: torch.Tensor, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch and its targets after MixUp/CutMix, drawn from a generator seeded by the run's
    seed and the batch's number in the run: a resumed or repeated run mixes the same way."""
    if training.mix is None:
        return images, labels
    with torch.random.fork_rng(devices=[]):  # the draws happen on the CPU, whatever the device
        torch.manual_seed(training.seed * 1_000_003 + batch)
        return training.mix(images, labels)


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
    model: nn.Module  # as the loop calls it: in DDP and compiled where asked
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    criterion: nn.Module
    schedule: Schedule
    steps_per_epoch: int  # optimizer steps
    global_batch: int  # images per optimizer step, over all processes and accumulated batches
    seed: int = 0
    mix: Callable | None = None  # MixUp/CutMix of a batch: (images, labels) -> (images, soft targets)
    clip_grad_norm: float | None = None
    ema: WeightAverage | None = None
    accum_steps: int = 1  # batches per optimizer step
    stop_requested: Callable[[], bool] = never  # read every CHECK_EVERY steps; all ranks then stop


def build_training(placed: PlacedModel, args: argparse.Namespace, ctx: DistContext,
                   batches_per_epoch: int) -> Training:
    """Wrap a placed model for training (SyncBatchNorm, DDP, compile) and build its optimizer,
    schedule, loss scaler, loss, batch mixing and weight average, as every launcher and the
    benchmarks train it. `batches_per_epoch`: the training loader's length in this process."""
    if args.sync_bn and ctx.distributed:
        placed = dataclasses.replace(placed, module=convert_sync_batchnorm(placed.module, ctx.device))
    model = placed.module
    if ctx.distributed:
        model = DDP(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
    if args.compile:
        model = torch.compile(model)  # checkpoints and evaluation use the uncompiled placed.module
    # Loss scaling keeps small fp16 gradients from flushing to zero; bf16 has fp32's range.
    scaler = torch.amp.GradScaler(ctx.device.type, enabled=placed.amp_dtype == torch.float16)
    steps_per_epoch = math.ceil(batches_per_epoch / args.accum_steps)
    return Training(placed, model, build_optimizer(placed.module, args), scaler,
                    nn.CrossEntropyLoss(label_smoothing=args.label_smoothing),
                    build_schedule(args, peak_lr(args, ctx), steps_per_epoch), steps_per_epoch,
                    global_batch(args, ctx), args.seed, build_mix(args, placed.module),
                    args.clip_grad_norm, WeightAverage(placed.module, args.ema_decay) if args.ema else None,
                    args.accum_steps)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def train_one_epoch(training: Training, loader: Iterable, ctx: DistContext, epoch: int, epochs: int,
                    steps_done: int = 0, sums_so_far: Sequence[float] = (0.0, 0.0, 0.0)) -> dict[str, float]:
    """One pass over this rank's shard, or its rest after `steps_done` batches that summed to
    `sums_so_far` over all ranks: a training step per batch, its loss and accuracy tallied,
    and every CHECK_EVERY optimizer steps a look at the tally (EpochTally.look)."""
    set_train_mode(training.model)
    tally = EpochTally(ctx, sums_so_far)
    steps = Accumulation(training.accum_steps, steps_done + len(loader), (epoch - 1) * training.steps_per_epoch)
    # Bars on rank 0 only, and only on a terminal (disable=None): logs stay free of them.
    bar = tqdm(loader, desc=f"epoch {epoch}/{epochs}", disable=None if ctx.is_main else True, leave=False,
               dynamic_ncols=True)
    for batch, (images, labels) in enumerate(tally.waited(bar), start=steps_done):
        at = steps.place(batch)
        loss, logits, labels = train_step(training, images, labels, at, ctx)
        tally.add(loss, logits, labels, batch)
        if at.look:
            tally.look(training, epoch, batch, steps.batches, bar)
    bar.close()
    return tally.reduced()


def train_step(training: Training, images: torch.Tensor, labels: torch.Tensor, at: StepPlace,
               ctx: DistContext) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One batch: forward, backward, and on the batch that closes an optimizer step the step
    itself. DDP all-reduces the gradients during that batch's backward pass; the batches
    before it in the step (--accum-steps) add theirs up locally (no_sync). The loss, the
    logits and the labels, on the device."""
    model, placed = training.model, training.placed
    images = placed.input(images)
    labels = labels.to(ctx.device, non_blocking=True)
    set_lr(training.optimizer, training.schedule(at.optimizer_step))
    inputs, targets = mixed(training, images, labels, at.batch_in_run)
    with contextlib.nullcontext() if at.closes or not ctx.distributed else model.no_sync():
        with torch.autocast(ctx.device.type, dtype=placed.amp_dtype, enabled=placed.amp_dtype is not None):
            logits = model(inputs)
            loss = training.criterion(logits, targets)
        training.scaler.scale(loss / at.batches_in_step).backward()  # the step takes the mean of its batches
    if at.closes:
        apply_gradients(training, at.optimizer_step + 1)
    return loss.detach(), logits, labels


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
    one optimizer step, and the epoch's last step takes the batches that are left."""

    def __init__(self, k: int, batches: int, steps_before: int):
        self.k, self.batches, self.steps_before = k, batches, steps_before  # steps_before: the earlier epochs' steps

    def place(self, batch: int) -> StepPlace:
        k, in_epoch = self.k, batch // self.k
        closes = (batch + 1) % k == 0 or batch + 1 == self.batches
        return StepPlace(self.steps_before + in_epoch, closes, min(k, self.batches - in_epoch * k),
                         self.steps_before * k + batch,
                         closes and ((in_epoch + 1) % CHECK_EVERY == 0 or batch + 1 == self.batches))


class EpochTally:
    """An epoch's loss and accuracy as running sums on the device (loss x images, correct),
    the images counted on the host, the first batch whose loss was not finite, and the
    seconds the loop stood waiting for data. Nothing here makes the host wait for the device
    but `look` and `reduced`, each one collective."""

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

    def reduced(self) -> dict[str, float]:
        """The epoch's metrics over all ranks, in one all-reduce. epoch_images: what the whole
        epoch trained on; train_images: what this call trained on (a resumed epoch's rest),
        for the images/s figure."""
        self.sums[2] += self.images
        loss_sum, correct, count, waits = all_reduce_sum(torch.cat([self.sums, self.sums.new_tensor([self.data_wait])]),
                                                         self.ctx).tolist()
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

    def __init__(self, batches: Callable[[], Sequence[torch.Tensor]]):
        self.batches = batches

    @torch.no_grad()
    def __call__(self, placed: PlacedModel, ctx: DistContext) -> PlacedModel:
        module = copy.deepcopy(placed.module)
        for norm in batch_norms(module):
            norm.reset_running_stats()
            norm.momentum = None  # a plain average over the batches, not a moving one
        module.train()
        for images in self.batches():
            module(placed.input(images))
        module.eval()
        broadcast_buffers(module, ctx)  # GPU kernels need not repeat to the bit: rank 0's, everywhere
        return dataclasses.replace(placed, module=module)


def batch_norms(module: nn.Module) -> list[nn.modules.batchnorm._BatchNorm]:
    return [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def batch_norm_statistics(module: nn.Module) -> dict[str, torch.Tensor]:
    """The BatchNorm buffers of `module` (running mean, variance and batch count), by state-dict key."""
    names = {id(m): name for name, m in module.named_modules()}
    return {f"{names[id(m)]}.{key}".lstrip("."): value.detach().clone()
            for m in batch_norms(module) for key, value in m.named_buffers(recurse=False)}


def evaluate(placed: PlacedModel, loader: Iterable, ctx: DistContext) -> dict[str, float]:
    """Exact accuracy and mean loss over the whole validation split."""
    return validation_metrics(validation_outputs(placed, loader), ctx)


@torch.no_grad()
def validation_metrics(outputs: Outputs, ctx: DistContext) -> dict[str, float]:
    """Exact accuracy and mean loss over the whole validation split: each rank saw a disjoint
    shard without padding, so every image counts exactly once. The logits are fp32 (evaluation
    runs without autocast): bf16 rounding could differ with the batch composition, which
    changes with the world size, and flip a borderline image."""
    sums = torch.zeros(3, dtype=torch.float64, device=ctx.device)  # loss sum, correct, images
    images_seen = 0
    criterion = nn.CrossEntropyLoss(reduction="sum")
    for logits, labels, _ in outputs:
        sums[:2] += torch.stack([criterion(logits, labels).double(), (logits.argmax(1) == labels).sum().double()])
        images_seen += labels.numel()
    sums[2] = images_seen
    loss_sum, correct, count = all_reduce_sum(sums, ctx).tolist()
    return {"val_loss": loss_sum / count, "val_acc": correct / count, "val_correct": int(correct), "val_total": int(count)}
