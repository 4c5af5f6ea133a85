"""Optimizers and LR schedules that run inside a CUDA graph unchanged.

The learning rate is a device tensor held by the optimizer's param groups; the
schedule writes it in place from a device step counter, so a schedule advances across
graph replays with no re-capture and no host sync. On CUDA the optimizers use their
fused kernels, which accept a tensor learning rate and keep their step counts on the
device (Adam/AdamW are also built ``capturable=True``, which capture requires).
"""
from __future__ import annotations

import math
from typing import Iterable

import torch

from recipes.runtime import ConfigError

OPTIMIZERS = ("sgd", "adam", "adamw")
SCHEDULES = ("constant", "cosine")


def build_optimizer(cfg, params: Iterable[torch.nn.Parameter], device: torch.device) -> torch.optim.Optimizer:
    on_cuda = device.type == "cuda"
    lr = torch.tensor(float(cfg.lr), dtype=torch.float32, device=device)
    if cfg.lr <= 0:
        raise ConfigError(f"recipe.optim.lr={cfg.lr} must be positive: set recipe.optim.lr=...")
    if cfg.name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=cfg.momentum, nesterov=cfg.nesterov,
                               weight_decay=cfg.weight_decay, fused=on_cuda or None)
    if cfg.name in ("adam", "adamw"):
        cls = torch.optim.AdamW if cfg.name == "adamw" else torch.optim.Adam
        # CUDA: fused kernels, capturable (torch refuses to capture Adam's step otherwise).
        # CPU: foreach=False, since foreach Adam refuses a tensor lr unless capturable.
        kwargs = {"fused": True, "capturable": True} if on_cuda else {"foreach": False}
        return cls(params, lr=lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay, **kwargs)
    raise ConfigError(f"recipe.optim.name={cfg.name!r} is not one of {', '.join(OPTIMIZERS)}: "
                      "set recipe.optim.name=sgd")


class LRSchedule:
    """lr(step) = base · warm-up factor · (constant | cosine decay to min_lr_ratio · base)."""

    def __init__(self, cfg, base_lr: float, total_steps: int):
        if cfg.name not in SCHEDULES:
            raise ConfigError(f"recipe.schedule.name={cfg.name!r} is not one of {', '.join(SCHEDULES)}: "
                              "set recipe.schedule.name=constant")
        if cfg.warmup_steps < 0:
            raise ConfigError(f"recipe.schedule.warmup_steps={cfg.warmup_steps} must be >= 0")
        self.name, self.base_lr, self.total_steps = cfg.name, base_lr, max(total_steps, 1)
        self.warmup_steps, self.min_lr_ratio = cfg.warmup_steps, cfg.min_lr_ratio

    @property
    def is_constant(self) -> bool:
        return self.name == "constant" and self.warmup_steps == 0

    def value(self, step: torch.Tensor) -> torch.Tensor:
        """The lr for 0-based ``step`` (a device tensor), computed on the device."""
        s = step.to(torch.float32)
        lr = torch.full_like(s, self.base_lr)
        if self.warmup_steps > 0:
            lr = lr * torch.clamp((s + 1) / self.warmup_steps, max=1.0)
        if self.name == "cosine":
            span = max(self.total_steps - self.warmup_steps, 1)
            progress = torch.clamp((s - self.warmup_steps) / span, 0.0, 1.0)
            ratio = self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + torch.cos(math.pi * progress))
            lr = lr * ratio
        return lr

    def apply(self, step: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
        if self.is_constant:
            return
        value = self.value(step)
        for group in optimizer.param_groups:
            group["lr"].copy_(value)
