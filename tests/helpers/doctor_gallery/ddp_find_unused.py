"""DDP with find_unused_parameters=True: it copies its used-parameter map between host and device."""
from __future__ import annotations

import torch.nn as nn

import torch
import torch.nn.functional as F

from . import Case, batches, sgd


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 16)
        self.head = nn.Linear(16, 1)
        self.aux = nn.Linear(16, 1)  # never used: why find_unused_parameters was turned on

    def forward(self, x):
        return self.head(torch.relu(self.body(x)))


def build(device):
    torch.manual_seed(0)
    model = TwoHeads().to(device)
    optimizer = sgd(model, device)

    def step(model, x, y):
        optimizer.zero_grad(set_to_none=True)
        out = model(x)  # doctor: ddp_find_unused_parameters
        loss = F.mse_loss(out, y)
        loss.backward()
        optimizer.step()
        return loss.detach()

    return Case(step, model, optimizer, batches(device), verdict="blocked", expect="fails",
                needs_process_group=True, ddp_kwargs={"find_unused_parameters": True})
