"""A history of losses kept in Python: memory grows each step, and a replayed graph appends nothing."""
from __future__ import annotations

import torch.nn.functional as F

from . import Case, batches, sgd, small_model


def build(device):
    model, history = small_model(device), []
    optimizer = sgd(model, device)

    def step(model, x, y):
        optimizer.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        history.append(loss.detach())  # doctor: memory_growth
        return loss.detach()

    return Case(step, model, optimizer, batches(device), verdict="captures-but-wrong", expect="differs",
                extra=lambda: [float(len(history))])
