"""A loss weight annealed in Python: the graph keeps the number it saw at capture."""
from __future__ import annotations

import torch.nn.functional as F

from . import Case, batches, sgd, small_model


def build(device):
    model, calls = small_model(device), [0]
    optimizer = sgd(model, device)

    def step(model, x, y):
        calls[0] += 1
        weight = 1.0 / calls[0]
        optimizer.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x), y) * weight  # doctor: python_scalar
        loss.backward()
        optimizer.step()
        return loss.detach()

    return Case(step, model, optimizer, batches(device), verdict="captures-but-wrong", expect="differs")
