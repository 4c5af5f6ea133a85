"""Noise from a torch.Generator of the step's own: the graph does not know it (the capture fails)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import Case, batches, sgd, small_model


def build(device):
    model = small_model(device)
    optimizer = sgd(model, device)
    gen = torch.Generator(device=device)
    gen.manual_seed(7)

    def step(model, x, y):
        optimizer.zero_grad(set_to_none=True)
        noise = torch.randn(x.shape, generator=gen, device=x.device)  # doctor: unregistered_generator
        loss = F.mse_loss(model(x + 0.01 * noise), y)
        loss.backward()
        optimizer.step()
        return loss.detach()

    return Case(step, model, optimizer, batches(device), verdict="blocked", expect="fails")
