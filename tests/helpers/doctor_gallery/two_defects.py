"""Two defects in one step: a Python-float lr schedule and `.item()`. Both are named."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import Case, batches, small_model


def build(device):
    model, calls, seen = small_model(device), [0], []
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)

    def step(model, x, y):
        calls[0] += 1
        optimizer.param_groups[0]["lr"] = 0.05 / calls[0]  # doctor: lr_frozen
        optimizer.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x), y)
        seen.append(float(loss.detach()))  # doctor: host_sync
        loss.backward()
        optimizer.step()
        return loss.detach()

    return Case(step, model, optimizer, batches(device), verdict="blocked", expect="fails")
