"""GradScaler with an optimizer that cannot take the scale itself (capturable Adam, not fused):
scaler.step reads the inf check on the host. (Fused ones take it on the device; GraphedStep makes
SGD fused, so plain SGD is no example of this any more.)"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import Case, batches, small_model


def build(device):
    model = small_model(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, capturable=device.type == "cuda")  # not fused
    scaler = torch.amp.GradScaler(device.type)

    def step(model, x, y):
        optimizer.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)  # doctor: grad_scaler
        scaler.update()
        return loss.detach()

    return Case(step, model, optimizer, batches(device), verdict="blocked", expect="fails")
