"""A graph-safe step: device-tensor lr, metrics summed on the device, fixed shapes. Ready."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import Case, batches, sgd, small_model


def build(device):
    model = small_model(device)
    optimizer = sgd(model, device)
    total = torch.zeros((), device=device)

    def step(model, x, y):
        optimizer.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        total.add_(loss.detach())
        return loss.detach()

    return Case(step, model, optimizer, batches(device), verdict="ready", expect="matches",
                extra=lambda: [float(total)])
