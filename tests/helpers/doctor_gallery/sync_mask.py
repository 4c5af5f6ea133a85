"""Boolean-mask indexing and torch.nonzero: outputs whose size depends on the data."""
from __future__ import annotations

import torch

from . import Case, batches, sgd, small_model


def build(device):
    model = small_model(device)
    optimizer = sgd(model, device)

    def step(model, x, y):
        optimizer.zero_grad(set_to_none=True)
        errors = (model(x) - y).abs().squeeze(1)
        big = errors[errors > 0]  # doctor: host_sync
        hard = torch.nonzero(errors > errors.mean()).squeeze(1)  # doctor: host_sync
        focus = torch.zeros_like(errors).scatter_(0, hard, 1.0)  # 1 on the hard samples
        loss = big.mean() + 0.1 * (focus * errors).mean()
        loss.backward()
        optimizer.step()
        return loss.detach()

    return Case(step, model, optimizer, batches(device), verdict="blocked", expect="fails")
