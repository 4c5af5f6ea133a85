"""torch.linalg.inv checks its result on the host (a sync inside the C++ op, no Python call shows it).

Only CUDA's own sync detection sees this one: the doctor needs a GPU for it (torch.linalg.inv_ex
is the fix).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import Case, batches, sgd, small_model


def build(device):
    model = small_model(device)
    optimizer = sgd(model, device)
    eye = torch.eye(4, device=device)

    def step(model, x, y):
        optimizer.zero_grad(set_to_none=True)
        w = model[0].weight
        penalty = torch.linalg.inv(w.T @ w + eye).diagonal().sum()  # doctor: host_sync
        loss = F.mse_loss(model(x), y) + 1e-4 * penalty
        loss.backward()
        optimizer.step()
        return loss.detach()

    return Case(step, model, optimizer, batches(device), verdict="blocked", expect="fails", needs_cuda=True)
