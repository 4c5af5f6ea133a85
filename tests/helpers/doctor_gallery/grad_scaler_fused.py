"""fp16's documented GradScaler usage with a fused optimizer, which takes the scale and the inf
check on the device: scale, unscale before clipping, step, update are all graph-safe. Ready, and
the graphed steps match eager ones (CUDA: float16 autocast and fused AdamW)."""
from __future__ import annotations

import torch

from . import Case, batches, fp16_scaled_step, small_model


def build(device):
    model = small_model(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0 ** 10, growth_interval=4)
    return Case(fp16_scaled_step(optimizer, scaler), model, optimizer, batches(device), verdict="ready",
                expect="matches", needs_cuda=True, extra=lambda: [scaler.get_scale()])
