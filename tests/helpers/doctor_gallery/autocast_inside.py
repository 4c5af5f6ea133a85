"""autocast with its weight cache on, entered inside the step: ready.

The cache lives only while the step's autocast region does, so the casts are captured with the
step. On torch 2.11 (H200) this captures and replays exactly like eager; the doctor does not
report it (tests/test_doctor_gpu.py checks that it still holds).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import Case, batches, sgd, small_model


def build(device):
    model = small_model(device)
    optimizer = sgd(model, device)

    def step(model, x, y):
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            out = model(x) + model(0.5 * x)
        loss = F.mse_loss(out.float(), y)
        loss.backward()
        optimizer.step()
        return loss.detach()

    return Case(step, model, optimizer, batches(device), verdict="ready", expect="matches")
