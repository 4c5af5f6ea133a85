"""`.item()` in the step: the host waits for the device, which a capture refuses."""
from __future__ import annotations

import torch.nn.functional as F

from . import Case, batches, sgd, small_model


def build(device):
    model, seen = small_model(device), []
    optimizer = sgd(model, device)

    def step(model, x, y):
        optimizer.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        seen.append(loss.item())  # doctor: host_sync
        return loss.detach()

    return Case(step, model, optimizer, batches(device), verdict="blocked", expect="fails")
