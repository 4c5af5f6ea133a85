"""Adam built without capturable=True that has already stepped before it is handed over: its step
counters were made on the host, where a captured step would freeze them. (Handed over before its
first step, GraphedStep turns capturable on itself: see adam_as_built.py.)"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import Case, batches, small_model


def build(device):
    model = small_model(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    inputs = batches(device)

    def step(model, x, y):
        optimizer.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()  # doctor: optimizer
        return loss.detach()

    step(model, *inputs())  # a step of the user's own, before the hand-over
    return Case(step, model, optimizer, inputs, verdict="blocked", expect="fails")
