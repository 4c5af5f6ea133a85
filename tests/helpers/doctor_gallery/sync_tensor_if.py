"""A tensor in an `if` (skip the update on a non-finite loss): Python needs the value on the host."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import Case, batches, sgd, small_model


def build(device):
    model = small_model(device)
    optimizer = sgd(model, device)

    def step(model, x, y):
        optimizer.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x), y)
        if torch.isfinite(loss):  # doctor: host_sync
            loss.backward()
            optimizer.step()
        return loss.detach()

    return Case(step, model, optimizer, batches(device), verdict="blocked", expect="fails")
