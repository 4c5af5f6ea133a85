"""A Python `if` on a step counter: the graph replays the path taken at capture, every time."""
from __future__ import annotations

import torch.nn.functional as F

from . import Case, batches, sgd, small_model


def build(device):
    model, calls = small_model(device), [0]
    optimizer = sgd(model, device)

    def step(model, x, y):
        calls[0] += 1
        optimizer.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x), y)
        if calls[0] % 3 == 0:  # every third step, an L2 penalty
            loss = loss + 1e-2 * model[0].weight.square().sum()  # doctor: control_flow
        loss.backward()
        optimizer.step()
        return loss.detach()

    return Case(step, model, optimizer, batches(device), verdict="captures-but-wrong", expect="differs")
