"""`param_group['lr'] = lr` written inside the step: a replay never runs that write, so the graph
would keep the capture's lr. GraphedStep refuses the step at its first call."""
from __future__ import annotations

import graphing

import torch
import torch.nn.functional as F

from . import Case, batches, small_model


def build(device):
    model, calls = small_model(device), [0]
    kwargs = graphing.graph_safe_optimizer_kwargs(torch.optim.SGD, device, {"momentum": 0.9})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, **kwargs)

    def step(model, x, y):
        calls[0] += 1
        for group in optimizer.param_groups:
            group["lr"] = 0.05 * 0.8 ** calls[0]  # doctor: lr_frozen
        optimizer.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        return loss.detach()

    return Case(step, model, optimizer, batches(device), verdict="blocked", expect="fails")
