"""Adam built without capturable=True: its step counter stays on the host, and a capture refuses it."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from doctor_gallery import Case, batches, small_model


def build(device):
    model = small_model(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    def step(model, x, y):
        optimizer.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()  # doctor: optimizer
        return loss.detach()

    return Case(step, model, optimizer, batches(device), verdict="blocked", expect="fails")
