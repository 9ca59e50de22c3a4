"""The profile experiment: where one of our training steps spends the device's time, by kind of
kernel, against the arithmetic the step must do. Synthetic input (random pixels already on the
device), so the figure is the step's alone: what the throughput benchmark's synthetic row
measures, taken apart."""
from __future__ import annotations

import argparse
import time
from typing import Any

import torch
from torch import nn
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.instruments import Run, write_result
from benchmarks.ours_recipe import ours_plan, ours_split
from model import model_for
from multi_train_utils.distributed_utils import autocast_dtype, process_context
from multi_train_utils.train_eval_utils import Extras, Progress, build_optimizer, train_one_epoch
from recipe import extras

# A kernel's (or, on the CPU, an operator's) kind, by the first words found in its name, in
# this order: cuDNN's BatchNorm kernels are named bn_*, its convolutions *fprop*/*dgrad*/*wgrad*.
KINDS = (
    ("batch norm", ("batch_norm", "batchnorm", "bn_fw", "bn_bw", "bn_")),
    ("convolution", ("conv", "fprop", "dgrad", "wgrad", "xmma", "implicit")),
    ("matrix product", ("gemm", "cutlass", "addmm", "matmul", "linear")),
    ("optimizer", ("sgd", "multi_tensor")),
    ("copy or layout change", ("nchwtonhwc", "nhwctonchw", "transpose", "copy")),
    ("pooling", ("pool",)),
    ("elementwise", ("elementwise", "relu", "clamp", "threshold", "add", "mul", "where")),
    ("reduction", ("reduce", "sum", "max", "softmax", "nll")),
)

DEFINITIONS = {
    "images_per_sec": "batch x steps / time of the steps, timed apart from the profiled ones (CUDA events or the host clock)",
    "flop_per_image": "floating-point operations of one image's forward and backward (torch.utils.flop_counter; "
                      "a multiply-add is 2)",
    "achieved_tflops": "flop_per_image x images_per_sec",
    "kinds": "device time per step of each kind of kernel (CPU: self time of each kind of operator), "
             "from torch.profiler over the profiled steps",
    "busy_ms_per_step": "the sum of kinds: time the device spent in kernels per step, against step_ms",
    "kernels_per_step": "kernels (CPU: operators) the profiler recorded per step",
}


def kind_of(name: str) -> str:
    lowered = name.lower()
    return next((kind for kind, words in KINDS if any(w in lowered for w in words)), "other")


def flop_per_image(args: argparse.Namespace, device: torch.device) -> float:
    model = model_for(args, 5).to(device)
    counter = FlopCounterMode(display=False)
    with counter:  # two images: BatchNorm in training mode needs more than one value per channel
        model(torch.randn(2, 3, args.img_size, args.img_size, device=device)).sum().backward()
    return counter.get_total_flops() / 2


def profile_steps(args: argparse.Namespace) -> dict[str, Any]:
    """The `profile` command."""
    run = Run("profile", args.machine)
    device_option = ["--device", args.device] if args.device else []
    plan = ours_plan(args.data_path, args.img_size, args.batch_size, device_option + args.options)
    ctx = process_context(None, plan.args.device)
    cuda = ctx.device.type == "cuda"
    # The model, optimizer and step as train_single_gpu.py builds them.
    torch.manual_seed(0)
    model = model_for(plan.args, len(plan.class_names))
    memory_format = torch.channels_last if plan.args.channels_last else torch.contiguous_format
    model.to(ctx.device, memory_format=memory_format)
    amp_dtype = autocast_dtype(plan.args.amp, ctx.device)  # the launchers' job_precision, without its line
    if cuda:  # cuDNN's autotuning; a CUDA graph's side stream
        extras.prepare_gpu(plan.args, ctx)
    compiled = torch.compile(model) if plan.args.compile else model
    optimizer, scaler = build_optimizer(model, plan.args, amp_dtype)
    criterion = nn.CrossEntropyLoss(label_smoothing=plan.args.label_smoothing)
    extra = Extras()
    if plan.args.ema or plan.args.mixup_alpha or plan.args.cutmix_alpha or plan.args.bn_recalibrate or cuda:
        extra = extras.training_extras(compiled, model, optimizer, ours_split(plan), plan.args, ctx)  # and a CUDA graph
    shape = (args.batch_size, 3, args.img_size, args.img_size)
    batch = (torch.randint(256, shape, dtype=torch.uint8, device=ctx.device).contiguous(memory_format=memory_format),
             torch.randint(len(plan.class_names), (args.batch_size,), device=ctx.device))

    def steps(count: int) -> float:
        """Seconds of `count` training steps, the device's work included."""
        if cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        # ends with a host read: the work is done
        train_one_epoch(compiled, criterion, optimizer, scaler, [batch] * count, 1, Progress(), amp_dtype, plan.args,
                        ctx, extra)
        return time.perf_counter() - started

    steps(args.warmup)  # autotuning, compilation
    seconds = steps(args.steps)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        steps(args.steps)
    events = [e for e in prof.key_averages()
              if (e.device_type == DeviceType.CUDA if cuda else e.device_type == DeviceType.CPU and e.key.startswith("aten::"))]
    per_step = {}
    for e in events:
        self_us = e.self_device_time_total if cuda else e.self_cpu_time_total
        per_step[kind_of(e.key)] = per_step.get(kind_of(e.key), 0.0) + self_us / 1000 / args.steps
    top = sorted(events, key=lambda e: -(e.self_device_time_total if cuda else e.self_cpu_time_total))[:12]
    flops = flop_per_image(plan.args, ctx.device)
    rate = args.batch_size * args.steps / seconds
    result = run.result(
        {"img_size": args.img_size, "batch_size": args.batch_size, "steps": args.steps, "warmup": args.warmup,
         "options": args.options, "device": str(ctx.device), "amp_dtype": str(amp_dtype)},
        definitions=DEFINITIONS, images_per_sec=round(rate, 1), step_ms=round(1000 * seconds / args.steps, 2),
        flop_per_image=flops, achieved_tflops=round(flops * rate / 1e12, 1),
        kinds={k: round(v, 3) for k, v in sorted(per_step.items(), key=lambda kv: -kv[1])},
        busy_ms_per_step=round(sum(per_step.values()), 3), kernels_per_step=sum(e.count for e in events) / args.steps,
        top=[{"name": e.key[:160], "ms_per_step": round((e.self_device_time_total if cuda else e.self_cpu_time_total)
                                                         / 1000 / args.steps, 3), "calls_per_step": e.count / args.steps}
             for e in top])
    write_result(result, args.out, profile_table(result))
    return result


def profile_table(result: dict[str, Any]) -> str:
    total = sum(result["kinds"].values())
    lines = [f"{result['images_per_sec']:.0f} img/s, {result['step_ms']:.1f} ms per step of "
             f"{result['settings']['batch_size']}; {result['flop_per_image'] / 1e9:.1f} GFLOP per image, "
             f"{result['achieved_tflops']:.1f} TFLOP/s achieved; the device busy {total:.2f} ms of each step, "
             f"{result['kernels_per_step']:.0f} kernels", "",
             "| kind | ms per step | share of profiled time |", "|---|---|---|"]
    lines += [f"| {kind} | {ms:.2f} | {100 * ms / total:.0f}% |" for kind, ms in result["kinds"].items()]
    return "\n".join(lines)
