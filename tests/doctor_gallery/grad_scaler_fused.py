"""fp16's documented GradScaler usage with a fused optimizer, which takes the scale and the inf
check on the device: scale, unscale before clipping, step, update are all graph-safe. Ready, and
the graphed steps match eager ones (CUDA: float16 autocast and fused AdamW)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from doctor_gallery import Case, batches, small_model


def build(device):
    model = small_model(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0 ** 10, growth_interval=4)

    def step(model, x, y):
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.float16, cache_enabled=False):
            loss = F.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        scaler.step(optimizer)
        scaler.update()
        return loss.detach()

    return Case(step, model, optimizer, batches(device), verdict="ready", expect="matches", needs_cuda=True,
                extra=lambda: [scaler.get_scale()])
