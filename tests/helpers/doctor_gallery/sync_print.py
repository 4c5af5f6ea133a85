"""print(tensor) in the step: printing reads the tensor's values on the host."""
from __future__ import annotations

import io

import torch.nn.functional as F

from . import Case, batches, sgd, small_model

LOG = io.StringIO()


def build(device):
    model = small_model(device)
    optimizer = sgd(model, device)

    def step(model, x, y):
        optimizer.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x), y)
        print("loss", loss, file=LOG)  # doctor: host_sync
        loss.backward()
        optimizer.step()
        return loss.detach()

    return Case(step, model, optimizer, batches(device), verdict="blocked", expect="fails")
