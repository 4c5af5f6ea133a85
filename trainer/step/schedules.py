"""Learning-rate schedules computed on the device, so that a captured step advances them.

A schedule turns the optimizer's device step counter into a learning rate with tensor
ops and writes it in place into the device ``lr`` tensor the optimizer holds: no host
sync, and a replayed graph reads the new value. Host-side schedulers
(``torch.optim.lr_scheduler``) assign Python floats between steps, which a captured
step never sees; they are refused.

Chosen by ``recipe.schedule._target_``; the trainer adds ``base_lr`` and ``total_steps``
to the config's keys. Your own schedule subclasses ``LRSchedule`` and implements
``value(step)`` with tensor ops.
"""
from __future__ import annotations

import math

import torch


class LRSchedule:
    """lr(step) for a 0-based device ``step`` tensor; ``warmup_steps`` of linear warm-up first."""

    def __init__(self, base_lr: float, total_steps: int, warmup_steps: int = 0):
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps={warmup_steps} must be >= 0")
        self.base_lr, self.total_steps, self.warmup_steps = float(base_lr), max(int(total_steps), 1), int(warmup_steps)

    @property
    def is_constant(self) -> bool:
        """True when ``value`` never changes: ``apply`` then launches no kernels."""
        return False

    def factor(self, step: torch.Tensor) -> torch.Tensor:
        """The multiplier of ``base_lr`` after warm-up (float32 tensor shaped like ``step``)."""
        raise NotImplementedError

    def value(self, step: torch.Tensor) -> torch.Tensor:
        s = step.to(torch.float32)
        lr = self.base_lr * self.factor(s)
        if self.warmup_steps > 0:
            lr = lr * torch.clamp((s + 1) / self.warmup_steps, max=1.0)
        return lr

    def apply(self, step: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
        """Writes lr(step) into every param group's lr tensor, in place."""
        if self.is_constant:
            return
        value = self.value(step)
        for group in optimizer.param_groups:
            group["lr"].copy_(value)


class Constant(LRSchedule):
    """base_lr throughout, after an optional linear warm-up."""

    @property
    def is_constant(self) -> bool:
        return self.warmup_steps == 0

    def factor(self, step: torch.Tensor) -> torch.Tensor:
        return torch.ones_like(step)


class Cosine(LRSchedule):
    """Linear warm-up, then a half cosine from base_lr down to ``min_lr_ratio`` · base_lr at the last step."""

    def __init__(self, base_lr: float, total_steps: int, warmup_steps: int = 0, min_lr_ratio: float = 0.0):
        super().__init__(base_lr, total_steps, warmup_steps)
        if not 0.0 <= min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio={min_lr_ratio} must be in [0, 1]")
        self.min_lr_ratio = float(min_lr_ratio)

    def factor(self, step: torch.Tensor) -> torch.Tensor:
        span = max(self.total_steps - self.warmup_steps, 1)
        progress = torch.clamp((step - self.warmup_steps) / span, 0.0, 1.0)
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + torch.cos(math.pi * progress))
