"""GradScaler with an unfused optimizer: scaler.step reads the inf check on the host."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from doctor_gallery import Case, batches, small_model


def build(device):
    model = small_model(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)  # foreach on CUDA, not fused
    scaler = torch.amp.GradScaler(device.type)

    def step(model, x, y):
        optimizer.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)  # doctor: grad_scaler
        scaler.update()
        return loss.detach()

    return Case(step, model, optimizer, batches(device), verdict="blocked", expect="fails")
