"""--scaling: what the processes of a multi-process run bought, printed by rank 0 at the end of
the run and kept in the run folder's scaling.json: images per second in all and per process,
and the share of a step spent waiting for data and for the gradients' all-reduce. `--check`
weighs a step under DDP against one without it (cluster/check_rows.py).

The images and seconds are the run's epochs in metrics.jsonl. The all-reduce figures are DDP's
own timers (`DistributedDataParallel._get_ddp_logging_data`): for each step it samples (steps 1
to 10, then every 100th: in a short run, mostly its first steps, the slow first one among them),
the time of the forward pass, of the backward pass's computation, of the gradients' all-reduce
from the first bucket sent to the last one done, and of the part of that all-reduce that ran
while the backward pass still computed. What the step waited for is the all-reduce less that
part. A step replayed as a CUDA graph runs none of DDP's hooks, so its all-reduce is not timed.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from multi_train_utils.distributed_utils import DistContext
from utils import read_metrics


def ddp_timers(model: nn.Module) -> dict[str, float] | None:
    """The training step's timers as DDP took them, in ms; None where it timed no step (one
    process, or a step replayed as a CUDA graph)."""
    ddp = getattr(model, "_orig_mod", model)  # under --compile
    if not isinstance(ddp, DDP):
        return None
    data = ddp._get_ddp_logging_data()
    names = {"forward_ms": "avg_forward_compute_time", "backward_ms": "avg_backward_compute_time",
             "all_reduce_ms": "avg_backward_comm_time", "hidden_ms": "avg_backward_compute_comm_overlap_time"}
    if not all(data.get(names[name], 0) > 0 for name in ("forward_ms", "backward_ms", "all_reduce_ms")):
        return None
    # No part hidden (one bucket, say): DDP leaves that average at 0, or out.
    return {name: data.get(key, 0) / 1e6 for name, key in names.items()}


def summary(records: list[dict[str, Any]], timers: dict[str, float] | None, world_size: int) -> dict[str, Any]:
    """The run's scaling figures from its epochs' records and DDP's timers."""
    images = sum(r["train_images_per_sec"] * r["epoch_seconds"] for r in records)
    seconds = sum(r["epoch_seconds"] for r in records)
    rate = images / seconds
    step_ms = 1000 * records[-1]["global_batch_size"] / rate  # a step: every process's batches, one all-reduce
    result: dict[str, Any] = {
        "processes": world_size, "images_per_sec": rate, "images_per_sec_per_process": rate / world_size,
        "step_ms": step_ms, "data_wait_share": sum(r["data_wait_seconds"] for r in records) / seconds,
        "all_reduce_wait_share": None, "ddp_timers_ms": timers,
    }
    if timers:
        waited = max(0.0, timers["all_reduce_ms"] - timers["hidden_ms"])
        result.update(all_reduce_wait_ms=waited, all_reduce_wait_share=waited / step_ms)
    return result


def line(result: dict[str, Any]) -> str:
    per_process = result["step_ms"] * result["images_per_sec_per_process"] / 1000
    head = (f"scaling: {result['processes']} processes trained {result['images_per_sec']:.1f} img/s in all, "
            f"{result['images_per_sec_per_process']:.1f} each; a step of {per_process:.0f} per process took "
            f"{result['step_ms']:.0f} ms, {result['data_wait_share']:.0%} of it waiting for data")
    timers = result["ddp_timers_ms"]
    if result["all_reduce_wait_share"] is None:
        return head + " (the all-reduce not timed: DDP timed no step, or the step was a replayed CUDA graph)"
    return (head + f" and {result['all_reduce_wait_share']:.0%} for the gradients' all-reduce "
            f"(DDP's timers: {timers['all_reduce_ms']:.0f} ms all-reduce, "
            f"{min(timers['hidden_ms'], timers['all_reduce_ms']):.0f} ms of it behind the backward pass)")


def report(output_dir: Path, model: nn.Module, ctx: DistContext) -> None:
    """Rank 0: the line and scaling.json; nothing for one process or a run that trained no step."""
    records = [r for r in read_metrics(output_dir) if r.get("epoch_seconds")]
    if ctx.world_size == 1 or not records:
        return
    result = summary(records, ddp_timers(model), ctx.world_size)
    (output_dir / "scaling.json").write_text(json.dumps(result, indent=2) + "\n")
    print(line(result), flush=True)
