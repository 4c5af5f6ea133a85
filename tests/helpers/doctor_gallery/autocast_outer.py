"""autocast (weight cache on) around the whole loop rather than inside the step.

A weight cast cached at the first step is reused after the optimizer changed the weight; the
graph keeps reading that cached copy, which is freed when the autocast region ends, while an
eager step casts afresh in the next region.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import Case, batches, sgd, small_model


def build(device):
    model = small_model(device)
    optimizer = sgd(model, device)

    def step(model, x, y):
        optimizer.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x).float(), y)
        loss.backward()
        optimizer.step()
        return loss.detach()

    def around(run):  # the user's epoch loop
        with torch.autocast(device.type, dtype=torch.bfloat16):  # doctor: autocast_cache
            return run()

    return Case(step, model, optimizer, batches(device), verdict="captures-but-wrong", expect="differs",
                around=around)
