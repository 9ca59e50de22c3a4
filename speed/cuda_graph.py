"""--cuda-graph: the training step (forward, loss, backward with DDP's all-reduce, the optimizer
step) captured once as a CUDA graph and replayed for every later batch of its shape: one launch
instead of several hundred, so that a small batch runs at the GPU's pace, not at Python's.

This follows PyTorch's CUDA semantics notes on whole-network capture: eager warm-up steps
first (cuDNN's autotuning, the optimizer's momentum buffers, the loss scaler's state, and under
DDP its bucket rebuild and the runtime statistics of its first ten iterations), capture on a
side stream, DDP built on that stream (it keeps its gradient hooks on the stream current when it
was built), static tensors each batch is copied into, the learning rate a tensor the graph
reads, autocast without its cache of cast weights. A batch of another shape (an epoch's last,
smaller batch) runs eagerly, on the same weights and optimizer state; a new image size
(--min-img-size's ramp) is captured again after its own warm-up."""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn

from multi_train_utils.config import blockers


def wanted(args: argparse.Namespace, device: torch.device) -> bool:
    """Whether this run's steps are graphed: --cuda-graph on, or auto on a GPU where the options
    allow it and it was tried (--sync-bn's collectives inside the forward pass were not)."""
    if args.cuda_graph == "off" or device.type != "cuda":
        return False
    # The graphed step under DDP has never run on two or more GPUs (one is the most the project's
    # test machines have had): until a run on several proves it, a job of several steps eagerly.
    several = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    return args.cuda_graph == "on" or not (blockers(args) or args.sync_bn or several)


def use_side_stream(device: torch.device) -> None:
    """Make a side stream this thread's current one, unless it already is: a graph cannot be
    captured on the default stream, and the DDP wrap built afterwards runs its gradient hooks on
    the stream that is current now, which must be the one captured."""
    current = torch.cuda.current_stream(device)
    if current == torch.cuda.default_stream(device):
        side = torch.cuda.Stream(device)
        side.wait_stream(current)  # the weights' copies and conversions queued so far come first
        torch.cuda.set_stream(side)


class GraphedStep:
    """One optimizer's training step as a CUDA graph, made after its warm-up and kept for the
    rest of the run (graphed_step). `replay` gives the step's loss and logits, or None where
    the caller must run this batch's step eagerly."""

    def __init__(self, optimizer: torch.optim.Optimizer, batch_size: int, under_ddp: bool, device: torch.device):
        # prepare_gpu (recipe/extras.py) made a side stream this thread's current one, before the DDP wrap.
        self.batch_size = batch_size
        # Eager steps before the capture; under DDP the notes' figure: DDP collects runtime statistics in its
        # first 10 iterations.
        self.warmup = 11 if under_ddp else 3
        self.shape: tuple = ()  # the shape the graph was captured for, or is warming up for
        self.eager_steps = 0  # eager steps of that shape so far
        self.graph: torch.cuda.CUDAGraph | None = None
        self.inputs = self.targets = self.loss = self.logits = None
        # The graph reads the learning rate from these tensors, where they were when it was captured: each replay
        # fills them with the rates train_one_epoch sets in the groups.
        self.lrs = [torch.tensor(float(group["lr"]), dtype=torch.float32, device=device) for group in optimizer.param_groups]

    def replay(self, inputs: torch.Tensor, targets: torch.Tensor, model: nn.Module, criterion: nn.Module,
               optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler, amp_dtype: torch.dtype | None,
               clip_grad_norm: float | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The step on this batch, replayed (captured first, the first time its warm-up is over);
        None: the caller runs it eagerly (a warm-up step, or a batch of another size)."""
        shape = (inputs.shape, inputs.dtype, targets.shape, targets.dtype)
        if self.graph is None or shape != self.shape:
            if inputs.shape[0] != self.batch_size:
                return None  # an epoch's last, smaller batch: one eager step an epoch costs little
            if shape != self.shape:
                self.shape, self.eager_steps = shape, 0
            if self.eager_steps < self.warmup:
                self.eager_steps += 1
                return None
            self._capture(inputs, targets, model, criterion, optimizer, scaler, amp_dtype, clip_grad_norm)
        self.inputs.copy_(inputs, non_blocking=True)
        self.targets.copy_(targets, non_blocking=True)
        for lr, group in zip(self.lrs, optimizer.param_groups):
            lr.fill_(group["lr"])
        self.graph.replay()
        return self.loss, self.logits

    def _capture(self, inputs: torch.Tensor, targets: torch.Tensor, model: nn.Module, criterion: nn.Module,
                 optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler, amp_dtype: torch.dtype | None,
                 clip_grad_norm: float | None) -> None:
        self.graph = self.inputs = self.targets = self.loss = self.logits = None  # a previous size's memory goes first
        inputs, targets = inputs.clone(), targets.clone()
        optimizer.zero_grad(set_to_none=True)  # the graph allocates the gradients it writes, in its own memory
        rates = [group["lr"] for group in optimizer.param_groups]
        for lr, group in zip(self.lrs, optimizer.param_groups):  # the fused step reads a tensor's address
            group["lr"] = lr.fill_(group["lr"])
        graph = torch.cuda.CUDAGraph()
        # thread_local: another thread of the process may touch CUDA meanwhile.
        with torch.cuda.graph(graph, stream=torch.cuda.current_stream(), capture_error_mode="thread_local"):
            with torch.autocast("cuda", dtype=amp_dtype, enabled=amp_dtype is not None, cache_enabled=False):
                logits = model(inputs)
                loss = criterion(logits, targets)
            scaler.scale(loss).backward()
            if clip_grad_norm is not None:
                scaler.unscale_(optimizer)
                nn.utils.clip_grad_norm_(model.parameters(), clip_grad_norm)
            scaler.step(optimizer)  # fused SGD takes the scaler's scale and overflow flag as tensors: no sync
            scaler.update()
        for group, rate in zip(optimizer.param_groups, rates):  # eager steps read a number again
            group["lr"] = rate
        # The eager steps of other sizes start from no gradients, as every eager step does.
        optimizer.zero_grad(set_to_none=True)
        self.graph, self.inputs, self.targets = graph, inputs, targets
        self.loss, self.logits = loss.detach(), logits.detach()


def graphed_step(optimizer: torch.optim.Optimizer, model: nn.Module, args: argparse.Namespace,
                 device: torch.device) -> GraphedStep | None:
    """`optimizer`'s graphed step, made once for the run (capturing costs a warm-up), or None where
    the run's steps are not graphed."""
    if not wanted(args, device):
        return None
    return GraphedStep(optimizer, args.batch_size, isinstance(model, nn.parallel.DistributedDataParallel), device)
