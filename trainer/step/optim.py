"""The optimizer and LR schedule: their specs, checked (``optimizer_spec``, ``schedule_spec``, which the plan
calls before the ranks meet, trainer/plan.py), then built from them and made graph-safe.

``recipe.optim`` names any optimizer class (``_target_: torch.optim.AdamW``); its other
keys are the class's arguments. It is a partial, as Hydra's ``_partial_: true`` says (the
key may be left out; any other value is refused when the plan checks the spec): the trainer adds the
parameters and the learning rate as a device tensor, and on CUDA the options that let
the step run inside a CUDA graph (``capturable``/``fused``, graphing/optimizers.py). A
class or setting that cannot be captured is refused before training, naming the key.
``recipe.schedule`` names a device-side schedule (trainer/step/schedules.py), completed with
``base_lr`` and ``total_steps`` the same way.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Dict, Iterable, Optional

import torch
from omegaconf import OmegaConf

from graphing import closure_problem, graph_safe_optimizer_kwargs, optimizer_capture_problem
from trainer.run.errors import ConfigError
from trainer.step.schedules import LRSchedule
from trainer.parallel.shard_optimizer import on_local_shards
from trainer.run.targets import import_target

# The optimizer classes with a fused step on FSDP2's DTensor shards (torch 2.11 to 2.15). DTensor has
# rules for the foreach and fused kernels of Adam and AdamW (a tensor lr included), and for the foreach
# kernels of SGD, but none for fused SGD, the only SGD step a graph can take (the others read a tensor
# lr on the host): trainer/parallel/sharding.py check_optimizer refuses SGD under a whole-step graph.
FUSED_ON_SHARDS = ("torch.optim.adam.Adam", "torch.optim.adamw.AdamW")


@dataclass(frozen=True)
class OptimizerSpec:
    """``recipe.optim``: the class, its keyword arguments (without ``lr``) and the base lr."""
    target: str
    cls: type
    kwargs: Dict[str, Any]
    lr: float
    accepted: frozenset  # the class's argument names


@dataclass(frozen=True)
class ScheduleSpec:
    """``recipe.schedule``: a device-side ``LRSchedule`` class and its keyword arguments."""
    target: str
    cls: type
    kwargs: Dict[str, Any]


def plain_settings(node) -> Dict[str, Any]:
    """A config node (or dict) as a plain dict, resolved."""
    return dict(node) if isinstance(node, dict) else OmegaConf.to_container(node, resolve=True)


def take_partial(settings: Dict[str, Any], key: str, added: str) -> None:
    """Takes Hydra's ``_partial_`` out of ``settings``: the trainer always completes the call itself
    (adding ``added``), so true, or no key, is the one value that describes it."""
    value = settings.pop("_partial_", True)
    if value is not True:
        shown = str(value).lower() if isinstance(value, bool) else repr(value)
        raise ConfigError(f"{key}._partial_={shown}: the trainer calls {key}._target_ itself, adding {added}, as "
                          f"Hydra's instantiate does with _partial_: true. Set {key}._partial_=true, or remove it "
                          f"(~{key}._partial_)")


def optimizer_spec(cfg_optim) -> OptimizerSpec:
    """``recipe.optim``, checked: an importable optimizer class, a positive lr, keys the class takes."""
    settings = plain_settings(cfg_optim)
    take_partial(settings, "recipe.optim", "the model's parameters (and the lr as a device tensor)")
    if "_target_" not in settings:
        raise ConfigError("recipe.optim has no _target_: set recipe.optim._target_=torch.optim.SGD (or any "
                          "optimizer class)")
    lr = settings.get("lr")
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or lr <= 0:
        raise ConfigError(f"recipe.optim.lr={lr!r} must be a positive number: set recipe.optim.lr=...")
    target = settings["_target_"]
    cls = import_target(target, "recipe.optim._target_", "torch.optim.AdamW")
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ConfigError(f"recipe.optim._target_={target!r} is not a torch.optim.Optimizer class: "
                          "set recipe.optim._target_=torch.optim.SGD (or another optimizer class)")
    problem = _closure_problem(cls, float(lr))
    if problem:
        raise ConfigError(f"recipe.optim._target_={target} cannot be used: {problem}; set "
                          "recipe.optim._target_=torch.optim.AdamW, for one")
    parameters = inspect.signature(cls).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    kwargs = {k: v for k, v in settings.items() if k not in ("_target_", "lr")}
    for key in kwargs:
        if key not in parameters and not takes_any:
            raise ConfigError(f"recipe.optim.{key} is not an argument of {target}: remove it "
                              f"(~recipe.optim.{key}) or choose a class that takes it")
    return OptimizerSpec(target=target, cls=cls, kwargs=kwargs, lr=float(lr), accepted=frozenset(parameters))


def _closure_problem(cls: type, lr: float) -> Optional[str]:
    """graphing's ``closure_problem`` for an optimizer class, asked of a one-parameter instance
    (nothing else is built before the ranks meet); None when that instance cannot be made:
    ``build_optimizer`` then says why."""
    try:
        probe = cls([torch.zeros(1, requires_grad=True)], lr=lr)
    except Exception:
        return None
    return closure_problem(probe)


def schedule_spec(cfg_schedule) -> ScheduleSpec:
    """``recipe.schedule``, checked: a device-side ``LRSchedule`` class."""
    settings = plain_settings(cfg_schedule)
    take_partial(settings, "recipe.schedule", "base_lr and total_steps")
    target = settings.pop("_target_", None)
    cls = import_target(target, "recipe.schedule._target_", "trainer.step.schedules.Cosine")
    if isinstance(cls, type) and issubclass(cls, torch.optim.lr_scheduler.LRScheduler):
        raise ConfigError(f"recipe.schedule._target_={target} is a host-side scheduler: it sets the lr as a Python "
                          "number between steps, which a CUDA graph never sees. Use trainer.step.schedules.Cosine, "
                          "trainer.step.schedules.Constant or a trainer.step.schedules.LRSchedule subclass")
    if not (isinstance(cls, type) and issubclass(cls, LRSchedule)):
        raise ConfigError(f"recipe.schedule._target_={target!r} is not a trainer.step.schedules.LRSchedule: "
                          "choose trainer.step.schedules.Constant or trainer.step.schedules.Cosine")
    return ScheduleSpec(target=target, cls=cls, kwargs=settings)


def check_captured_optimizer(spec: OptimizerSpec, captured: bool) -> None:
    """Refuses ``recipe.optim`` settings that keep the step off a CUDA graph when the step is captured
    (graph mode full): the plan's check, before the ranks meet."""
    if not captured:
        return
    for key in ("capturable", "fused"):
        if spec.kwargs.get(key) is False and "capturable" in spec.accepted:
            raise ConfigError(f"recipe.optim.{key}=false cannot run inside a CUDA graph: the step counter "
                              f"would stay on the host; remove recipe.optim.{key} or set graph=eager")


def build_optimizer(spec: OptimizerSpec, params: Iterable[torch.nn.Parameter], device: torch.device,
                    captured: bool, loss_scaled: bool = False, sharded: bool = False) -> torch.optim.Optimizer:
    """The optimizer ``spec`` names, with a device-tensor lr and graph-safe options.

    ``captured``: the optimizer's step runs inside a CUDA graph (graph mode full).
    ``loss_scaled``: a GradScaler drives its step (train.precision=fp16).
    ``sharded``: the parameters are FSDP2's DTensor shards, on which only Adam and AdamW have a fused
    kernel (``FUSED_ON_SHARDS``): another class steps with its foreach kernels there, uncaptured. Adam
    and AdamW step on each rank's local shards (trainer/parallel/shard_optimizer.py: bitwise the DTensor step,
    without its dispatch).
    """
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
