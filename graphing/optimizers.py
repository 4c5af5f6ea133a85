"""Optimizers that can step inside a captured graph, and the ones that cannot.

A captured ``optimizer.step()`` replays the same kernels on the same addresses. It is
right only when every value the step reads or writes lives on the device:
- the step counters: torch.optim classes keep them on the host unless built with
  ``capturable=True`` (or ``fused=True``); a captured host counter stays frozen, so bias
  correction would use step 1 forever. Adam/AdamW refuse to be captured otherwise.
- the learning rate: a Python float is baked into the graph as a constant. A tensor
  ``lr`` on the device can be rewritten in place between replays (a device-side
  schedule does that).
SGD keeps no step counter: its momentum buffers live on the device.
"""
from __future__ import annotations

import inspect
from typing import Any, Dict, Optional

import torch

# torch.optim classes that keep no host-side state in their step.
_HOST_STATE_FREE = (torch.optim.SGD,)


def _parameters(cls) -> Dict[str, inspect.Parameter]:
    try:
        return dict(inspect.signature(cls).parameters)
    except (TypeError, ValueError):
        return {}


def graph_safe_optimizer_kwargs(cls, device: torch.device, given: Dict[str, Any]) -> Dict[str, Any]:
    """Constructor arguments that make ``cls`` graph-safe and fast on ``device``.

    What the caller set in ``given`` is kept; only unset options are filled in. On CUDA:
    ``capturable=True`` where the class has it, and ``fused=True`` where it has that
    (not every class fuses on every device: a caller may retry without it). On the CPU
    ``foreach=False``, since foreach kernels refuse a tensor learning rate there.
    """
    params = _parameters(cls)
    out: Dict[str, Any] = {}
    if torch.device(device).type == "cuda":
        if "capturable" in params and "capturable" not in given:
            out["capturable"] = True
        if "fused" in params and "fused" not in given and "foreach" not in given:
            out["fused"] = True
    elif "foreach" in params and "foreach" not in given and "fused" not in given:
        out["foreach"] = False
    return out


def optimizer_capture_problem(optimizer: torch.optim.Optimizer) -> Optional[str]:
    """Why ``optimizer.step()`` would be wrong or refused inside a CUDA graph, or None."""
    cls = type(optimizer)
    name = f"{cls.__module__}.{cls.__qualname__}"
    for group in optimizer.param_groups:
        if group.get("capturable") or group.get("fused"):
            continue
        if isinstance(optimizer, _HOST_STATE_FREE):
            continue
        if "capturable" in group:
            return (f"{name} was built with capturable=False: its step counter stays on the host and a captured "
                    "step would freeze it; build it with capturable=True")
        if cls.__module__.startswith("torch.optim"):
            return (f"{name} has neither a capturable nor a fused CUDA mode: its step keeps host state that a "
                    "captured graph would freeze; use an optimizer that has one (SGD, Adam, AdamW, RMSprop, ...)")
    return None


def float_learning_rate(optimizer: torch.optim.Optimizer) -> bool:
    """True when a param group's lr is a Python number: a capture freezes it."""
    return any(not isinstance(group.get("lr"), torch.Tensor) for group in optimizer.param_groups)


def closure_problem(optimizer: torch.optim.Optimizer) -> Optional[str]:
    """Why ``optimizer.step()`` cannot be called without arguments, or None.

    A closure optimizer (``torch.optim.LBFGS``) re-evaluates the loss inside ``step(closure)``:
    it runs the forward pass several times per step, with host-side line searches, so it fits
    neither a step function that calls ``optimizer.step()`` nor a graph.
    """
    try:
        param = inspect.signature(type(optimizer).step).parameters.get("closure")
    except (TypeError, ValueError):
        return None
    if param is None or param.default is not inspect.Parameter.empty:
        return None
    cls = type(optimizer)
    return (f"{cls.__module__}.{cls.__qualname__}.step needs a closure (it re-evaluates the loss itself, with "
            "host-side decisions): use an optimizer whose step() takes no arguments (SGD, Adam, AdamW, ...)")
