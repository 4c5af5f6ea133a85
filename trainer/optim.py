"""The optimizer and LR schedule, built from config by ``_target_`` and made graph-safe.

``recipe.optim`` names any optimizer class (``_target_: torch.optim.AdamW``,
``_partial_: true``); its other keys are the class's arguments. The trainer adds the
parameters and the learning rate as a device tensor, and on CUDA the options that let
the step run inside a CUDA graph (``capturable``/``fused``, graphing/optimizers.py). A
class or setting that cannot be captured is refused before training, naming the key.
``recipe.schedule`` names a device-side schedule (trainer/schedules.py).
"""
from __future__ import annotations

import inspect
from typing import Any, Dict, Iterable

import torch
from omegaconf import OmegaConf

from graphing import graph_safe_optimizer_kwargs, optimizer_capture_problem
from trainer.errors import ConfigError
from trainer.schedules import LRSchedule
from trainer.targets import import_target


def _plain(node) -> Dict[str, Any]:
    return dict(node) if isinstance(node, dict) else OmegaConf.to_container(node, resolve=True)


def optimizer_settings(cfg_optim) -> Dict[str, Any]:
    """``recipe.optim`` as a plain dict, with ``_target_`` and a positive ``lr`` checked."""
    settings = _plain(cfg_optim)
    if "_target_" not in settings:
        raise ConfigError("recipe.optim has no _target_: set recipe.optim._target_=torch.optim.SGD (or any "
                          "optimizer class)")
    lr = settings.get("lr")
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or lr <= 0:
        raise ConfigError(f"recipe.optim.lr={lr!r} must be a positive number: set recipe.optim.lr=...")
    return settings


def optimizer_class(cfg_optim):
    target = optimizer_settings(cfg_optim)["_target_"]
    cls = import_target(target, "recipe.optim._target_", "torch.optim.AdamW")
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ConfigError(f"recipe.optim._target_={target!r} is not a torch.optim.Optimizer class: "
                          "set recipe.optim._target_=torch.optim.SGD (or another optimizer class)")
    return cls


def build_optimizer(cfg_optim, params: Iterable[torch.nn.Parameter], device: torch.device,
                    captured: bool) -> torch.optim.Optimizer:
    """The optimizer ``recipe.optim`` names, with a device-tensor lr and graph-safe options.

    ``captured``: the optimizer's step runs inside a CUDA graph (graph mode full).
    """
    settings = optimizer_settings(cfg_optim)
    cls = optimizer_class(cfg_optim)
    accepted = inspect.signature(cls).parameters
    given = {k: v for k, v in settings.items() if not k.startswith("_") and k != "lr"}
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    for key in given:
        if key not in accepted and not takes_any:
            raise ConfigError(f"recipe.optim.{key} is not an argument of {settings['_target_']}: remove it "
                              f"(~recipe.optim.{key}) or choose a class that takes it")
    if captured:
        for key in ("capturable", "fused"):
            if given.get(key) is False and "capturable" in accepted:
                raise ConfigError(f"recipe.optim.{key}=false cannot run inside a CUDA graph: the step counter "
                                  f"would stay on the host; remove recipe.optim.{key} or set graph=eager")
    lr = torch.tensor(float(settings["lr"]), dtype=torch.float32, device=device)  # schedules write it in place
    plain = {k: v for k, v in settings.items() if k not in ("_target_", "_partial_", "lr")}
    extra = graph_safe_optimizer_kwargs(cls, device, plain)
    params = list(params)

    try:
        try:
            optimizer = cls(params, lr=lr, **plain, **extra)
        except Exception as first:
            if not extra.pop("fused", False) or "fused" not in str(first).lower():
                raise
            optimizer = cls(params, lr=lr, **plain, **extra)  # this class does not fuse on this device
    except Exception as e:
        raise ConfigError(f"recipe.optim ({settings['_target_']}) could not be built: {_first_line(e)}; "
                          "check its keys under recipe.optim") from None
    if captured:
        problem = optimizer_capture_problem(optimizer)
        if problem:
            raise ConfigError(f"recipe.optim._target_: {problem} (or set graph=partial / graph=eager)")
    return optimizer


def build_schedule(cfg_schedule, base_lr: float, total_steps: int) -> LRSchedule:
    """The device-side schedule ``recipe.schedule`` names, for ``total_steps`` optimizer steps."""
    settings = _plain(cfg_schedule)
    target = settings.pop("_target_", None)
    settings.pop("_partial_", None)
    cls = import_target(target, "recipe.schedule._target_", "trainer.schedules.Cosine")
    if isinstance(cls, type) and issubclass(cls, torch.optim.lr_scheduler.LRScheduler):
        raise ConfigError(f"recipe.schedule._target_={target} is a host-side scheduler: it sets the lr as a Python "
                          "number between steps, which a CUDA graph never sees. Use trainer.schedules.Cosine, "
                          "trainer.schedules.Constant or a trainer.schedules.LRSchedule subclass")
    if not (isinstance(cls, type) and issubclass(cls, LRSchedule)):
        raise ConfigError(f"recipe.schedule._target_={target!r} is not a trainer.schedules.LRSchedule: "
                          "choose trainer.schedules.Constant or trainer.schedules.Cosine")
    try:
        return cls(base_lr=base_lr, total_steps=total_steps, **settings)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"recipe.schedule ({target}) could not be built: {_first_line(e)}; check its keys "
                          "under recipe.schedule") from None


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"
