"""Copies to the host inside the step: `.cpu()` and `.tolist()` wait for the device."""
from __future__ import annotations

import torch.nn.functional as F

from . import Case, batches, sgd, small_model


def build(device):
    model, stats = small_model(device), {}
    optimizer = sgd(model, device)

    def step(model, x, y):
        optimizer.zero_grad(set_to_none=True)
        out = model(x)
        loss = F.mse_loss(out, y)
        loss.backward()
        optimizer.step()
        stats["outputs"] = out.detach().cpu()  # doctor: host_sync
        stats["bias"] = model[2].bias.detach().tolist()  # doctor: host_sync
        return loss.detach()

    return Case(step, model, optimizer, batches(device), verdict="blocked", expect="fails")
