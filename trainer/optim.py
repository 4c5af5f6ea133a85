"""The optimizer and LR schedule, built from their checked specs (trainer/plan.py) and made graph-safe.

``recipe.optim`` names any optimizer class (``_target_: torch.optim.AdamW``); its other
keys are the class's arguments. It is a partial, as Hydra's ``_partial_: true`` says (the
key may be left out; any other value is refused by trainer/plan.py): the trainer adds the
parameters and the learning rate as a device tensor, and on CUDA the options that let
the step run inside a CUDA graph (``capturable``/``fused``, graphing/optimizers.py). A
class or setting that cannot be captured is refused before training, naming the key.
``recipe.schedule`` names a device-side schedule (trainer/schedules.py), completed with
``base_lr`` and ``total_steps`` the same way.
"""
from __future__ import annotations

from typing import Iterable

import torch

from graphing import graph_safe_optimizer_kwargs, optimizer_capture_problem
from trainer.errors import ConfigError
from trainer.plan import OptimizerSpec, ScheduleSpec
from trainer.schedules import LRSchedule
from trainer.shard_optimizer import on_local_shards
from trainer.sharding import FUSED_ON_SHARDS


def build_optimizer(spec: OptimizerSpec, params: Iterable[torch.nn.Parameter], device: torch.device,
                    captured: bool, loss_scaled: bool = False, sharded: bool = False) -> torch.optim.Optimizer:
    """The optimizer ``spec`` names, with a device-tensor lr and graph-safe options.

    ``captured``: the optimizer's step runs inside a CUDA graph (graph mode full).
    ``loss_scaled``: a GradScaler drives its step (train.precision=fp16).
    ``sharded``: the parameters are FSDP2's DTensor shards, on which only Adam and AdamW have a fused
    kernel (trainer/sharding.py): another class steps with its foreach kernels there, uncaptured. Adam
    and AdamW step on each rank's local shards (trainer/shard_optimizer.py: bitwise the DTensor step,
    without its dispatch).
    """
    if captured:
        for key in ("capturable", "fused"):
            if spec.kwargs.get(key) is False and "capturable" in spec.accepted:
                raise ConfigError(f"recipe.optim.{key}=false cannot run inside a CUDA graph: the step counter "
                                  f"would stay on the host; remove recipe.optim.{key} or set graph=eager")
    lr = torch.tensor(spec.lr, dtype=torch.float32, device=device)  # schedules write it in place
    plain = dict(spec.kwargs)
    extra = graph_safe_optimizer_kwargs(spec.cls, device, plain)
    if sharded and f"{spec.cls.__module__}.{spec.cls.__qualname__}" not in FUSED_ON_SHARDS and extra.pop("fused", False):
        extra["foreach"] = True
    params = list(params)
    cls = on_local_shards(spec.cls) if sharded else spec.cls  # Adam, AdamW: the step on local shards, exactly
    try:
        try:
            optimizer = cls(params, lr=lr, **plain, **extra)
        except Exception as first:
            if not extra.pop("fused", False) or "fused" not in str(first).lower():
                raise
            optimizer = cls(params, lr=lr, **plain, **extra)  # this class does not fuse on this device
    except Exception as e:
        raise ConfigError(f"recipe.optim ({spec.target}) could not be built: {_first_line(e)}; "
                          "check its keys under recipe.optim") from None
    if captured:
        problem = optimizer_capture_problem(optimizer)
        if problem:
            raise ConfigError(f"recipe.optim._target_: {problem} (or set graph=partial / graph=eager)")
        if loss_scaled and not getattr(optimizer, "_step_supports_amp_scaling", False):
            raise ConfigError(
                f"recipe.optim._target_={spec.target} with train.precision=fp16 under a whole-step graph: the loss "
                "scaler's step reads the inf check on the host unless the optimizer takes the scale itself, on the "
                "device, as the fused SGD, Adam and AdamW do (fused=True, the default here on CUDA) and this one "
                "does not; use one of those, train.precision=bf16, or graph=eager / graph=partial")
    return optimizer


def build_schedule(spec: ScheduleSpec, base_lr: float, total_steps: int) -> LRSchedule:
    """The device-side schedule ``spec`` names, for ``total_steps`` optimizer steps."""
    try:
        return spec.cls(base_lr=base_lr, total_steps=total_steps, **spec.kwargs)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"recipe.schedule ({spec.target}) could not be built: {_first_line(e)}; check its keys "
                          "under recipe.schedule") from None


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"
