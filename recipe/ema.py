"""--ema: an exponential moving average of the weights, evaluated beside them every epoch;
best.pth holds whichever scored higher."""
from __future__ import annotations

import copy

import torch
from torch import nn


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
