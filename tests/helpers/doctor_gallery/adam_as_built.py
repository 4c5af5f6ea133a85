"""AdamW as nanoGPT builds it: a float lr, fused on CUDA, no capturable. GraphedStep makes it
capturable before its first step and carries the lr: ready, and the graph matches eager."""
from __future__ import annotations

import torch

from . import Case, batches, mse_step, small_model


def build(device):
    model = small_model(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, fused=device.type == "cuda")
    return Case(mse_step(optimizer), model, optimizer, batches(device), verdict="ready", expect="matches")
