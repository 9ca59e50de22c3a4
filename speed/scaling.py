"""What the processes of a multi-process run bought: images per second in all and per process,
and the share of a step spent waiting for data and for the gradients' all-reduce. Printed by
rank 0 at the end of the run (the line after `time:`) and kept in the run folder's
scaling.json; `--check` weighs a step under DDP against one without it (check_rows.py).

The all-reduce figures are DDP's own timers (`DistributedDataParallel._get_ddp_logging_data`):
for each step it samples (steps 1 to 10, then every 100th: in a short run, mostly its first
steps, the slow first one among them), the time of the forward pass, of
the backward pass's computation, of the gradients' all-reduce from the first bucket sent to
the last one done, and of the part of that all-reduce that ran while the backward pass still
computed. What the step waited for is the all-reduce less that part. A step replayed as a CUDA
graph runs none of DDP's Python or C++ hooks, so its all-reduce is not timed.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

SCALING_FILE = "scaling.json"
# DDP's names for its averages over the steps it timed, in nanoseconds.
DDP_TIMERS = {"forward_ms": "avg_forward_compute_time", "backward_ms": "avg_backward_compute_time",
              "all_reduce_ms": "avg_backward_comm_time", "hidden_ms": "avg_backward_compute_comm_overlap_time"}


def ddp_timers(model: nn.Module, graphed: bool) -> dict[str, Any]:
    """The training step's timers as DDP took them so far, for train_one_epoch's result: empty
    for one process; None where the step is replayed as a CUDA graph."""
    ddp = getattr(model, "_orig_mod", model)  # under --compile
    if not isinstance(ddp, DDP):
        return {}
    if graphed:
        return {"ddp_timers": None}
    data = ddp._get_ddp_logging_data()
    if not all(data.get(DDP_TIMERS[name], 0) > 0 for name in ("forward_ms", "backward_ms", "all_reduce_ms")):
        return {}  # no step timed yet
    # No part hidden (one bucket, say): DDP leaves that average at 0, or out.
    return {"ddp_timers": {name: data.get(key, 0) / 1e6 for name, key in DDP_TIMERS.items()}}


class ScalingTally:
    """The run's epochs, as rank 0 saves them, summed into one summary."""

    def __init__(self, world_size: int, batch_size: int, accum_steps: int = 1):
        self.world_size, self.batch_size, self.accum_steps = world_size, batch_size, accum_steps
        self.images, self.seconds, self.data_wait = 0, 0.0, 0.0
        self.timers: dict[str, float] | None = None
        self.graphed = False

    def add(self, train_stats: dict[str, Any]) -> None:
        """One epoch's result of train_one_epoch (summed over the ranks). An epoch resumed after
        its last step trained nothing: it has nothing to say of the processes' speed."""
        if not train_stats["train_images"]:
            return
        self.images += train_stats["train_images"]
        self.seconds += train_stats["seconds"]
        self.data_wait += train_stats["data_wait_seconds"]
        if "ddp_timers" in train_stats:
            self.graphed = train_stats["ddp_timers"] is None
            self.timers = train_stats["ddp_timers"]  # DDP's averages since the start: the latest holds them all

    def summary(self) -> dict[str, Any]:
        rate = self.images / self.seconds
        # An optimizer step: --accum-steps batches on every process at once, one all-reduce.
        step_ms = 1000 * self.batch_size * self.accum_steps * self.world_size / rate
        result: dict[str, Any] = {
            "processes": self.world_size, "images_per_sec": rate, "images_per_sec_per_process": rate / self.world_size,
            "step_ms": step_ms, "data_wait_share": self.data_wait / self.seconds,
            "all_reduce_wait_share": None, "ddp_timers_ms": self.timers,
        }
        if self.timers:
            waited = max(0.0, self.timers["all_reduce_ms"] - self.timers["hidden_ms"])
            result.update(all_reduce_wait_ms=waited, all_reduce_wait_share=waited / step_ms)
        return result

    def line(self, summary: dict[str, Any]) -> str:
        head = (f"scaling: {summary['processes']} processes trained {summary['images_per_sec']:.1f} img/s in all, "
                f"{summary['images_per_sec_per_process']:.1f} each; a step of {self.batch_size * self.accum_steps} per process took "
                f"{summary['step_ms']:.0f} ms, {summary['data_wait_share']:.0%} of it waiting for data")
        if self.graphed:
            return head + ", the gradients' all-reduce inside the replayed CUDA graph (not timed)"
        if summary["all_reduce_wait_share"] is None:
            return head + " (the all-reduce not timed: DDP timed no step)"
        return (head + f" and {summary['all_reduce_wait_share']:.0%} for the gradients' all-reduce "
                f"(DDP's timers: {self.timers['all_reduce_ms']:.0f} ms all-reduce, "
                f"{min(self.timers['hidden_ms'], self.timers['all_reduce_ms']):.0f} ms of it behind the backward pass)")

    def report(self, output_dir: Path) -> None:
        """The line and scaling.json; nothing for one process or a run that trained no step."""
        if self.world_size == 1 or not self.images:
            return
        summary = self.summary()
        (output_dir / SCALING_FILE).write_text(json.dumps(summary, indent=2) + "\n")
        print(self.line(summary), flush=True)
