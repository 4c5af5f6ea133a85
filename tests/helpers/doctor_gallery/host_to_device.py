"""`torch.tensor(0.5, device=...)` in the step: a copy from host memory on every step."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import Case, batches, sgd, small_model


def build(device):
    model = small_model(device)
    optimizer = sgd(model, device)

    def step(model, x, y):
        optimizer.zero_grad(set_to_none=True)
        weight = torch.tensor(0.5, device=x.device)  # doctor: host_to_device_copy
        loss = weight * F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        return loss.detach()

    return Case(step, model, optimizer, batches(device), verdict="blocked", expect="fails")
