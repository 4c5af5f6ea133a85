"""Optimizers that can step inside a captured graph, and the ones that cannot.

A captured ``optimizer.step()`` replays the same kernels on the same addresses. It is
right only when every value the step reads or writes lives on the device:
- the step counters: torch.optim classes keep them on the host unless built with
  ``capturable=True``; a captured host counter stays frozen, so bias correction would use
  step 1 forever. Adam/AdamW refuse a capture unless every group is capturable, fused or
  not (``fused=True`` alone keeps the counters on the device but is refused all the same).
- the learning rate: a Python float is baked into the graph as a constant. A tensor
  ``lr`` on the device can be rewritten in place between replays (a device-side
  schedule does that; ``GraphedStep`` does it with the floats a loop writes, see
  graphing/hyperparams.py). SGD reads a tensor lr on the host (``.item()``) unless fused.
SGD keeps no step counter: its momentum buffers live on the device.

``make_graph_safe`` changes what can still be changed (before the optimizer's state
exists) and refuses the rest; ``optimizer_capture_problem`` judges an optimizer as built.
"""
from __future__ import annotations

import inspect
from typing import Any, Dict, List, Optional, Tuple

import torch

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


def _name(optimizer: torch.optim.Optimizer) -> str:
    cls = type(optimizer)
    return f"{cls.__module__}.{cls.__qualname__}"


def optimizer_capture_problem(optimizer: torch.optim.Optimizer) -> Optional[str]:
    """Why ``optimizer.step()``, as built, would be wrong or refused inside a CUDA graph, or None."""
    name = _name(optimizer)
    closure = closure_problem(optimizer)
    if closure:
        return closure
    for group in optimizer.param_groups:
        if "capturable" in group:
            if not group["capturable"]:
                return (f"{name} was built with capturable={group['capturable']}: its step counter stays on the "
                        "host and a captured step would freeze it (fused=True alone is refused too); build it "
                        "with capturable=True")
        elif isinstance(optimizer, torch.optim.SGD):
            if isinstance(group["lr"], torch.Tensor) and not group.get("fused"):
                return (f"{name} without fused=True reads a tensor lr on the host (.item()), which a capture "
                        "refuses; build it with fused=True")
        elif not group.get("fused") and type(optimizer).__module__.startswith("torch.optim"):
            return (f"{name} has neither a capturable nor a fused CUDA mode: its step keeps host state that a "
                    "captured graph would freeze; use an optimizer that has one (SGD, Adam, AdamW, RMSprop, ...)")
    return None


def make_graph_safe(optimizer: torch.optim.Optimizer, dry_run: bool = False) -> List[str]:
    """Turns on what a captured step needs where the optimizer still allows it; returns what changed.

    ``capturable=True`` for classes that have it, while no state exists yet (state made
    without it keeps its step counters on the host), and ``fused=True`` for SGD, whose
    other paths read a tensor lr on the host. Raises ``GraphConfigError`` with the fix
    when that is not enough (``optimizer_capture_problem`` of the result). ``dry_run``:
    says what it would change, and leaves the optimizer as it was.
    """
    from graphing.options import GraphConfigError, literal

    name = _name(optimizer)
    changes: List[Tuple[Dict[str, Any], str, str]] = []  # (a group or the defaults, key, why)
    for i, group in enumerate(optimizer.param_groups):
        stepped = any(optimizer.state.get(p) for p in group["params"])
        if "capturable" in group and not group["capturable"]:
            if stepped and not group.get("fused"):
                raise GraphConfigError(literal(
                    f"{name} was built with capturable=False and has stepped already: its step counters live on "
                    "the host, where a captured step would freeze them. Build it with capturable=True, or hand it "
                    "over before its first step (then it is made capturable for you)"))
            changes.append((group, "capturable", f"param_groups[{i}]: capturable=True"))
        if isinstance(optimizer, torch.optim.SGD) and not group.get("fused"):
            for flag in ("foreach", "differentiable"):
                if group.get(flag):
                    raise GraphConfigError(literal(
                        f"{name} was built with {flag}=True, whose step reads the learning rate on the host "
                        f"(.item()); a graph needs it on the device: build it with fused=True instead"))
            changes.append((group, "fused", f"param_groups[{i}]: fused=True (SGD's other paths read a tensor lr "
                                            "on the host)"))
    for key in {key for _, key, _ in changes}:
        changes.append((optimizer.defaults, key, ""))  # groups added later inherit it
    before = [(where, key, where.get(key, _ABSENT)) for where, key, _ in changes]
    for where, key, _ in changes:
        where[key] = True
    problem: Optional[str] = None
    try:
        problem = optimizer_capture_problem(optimizer)
    finally:
        if dry_run or problem:
            for where, key, value in before:
                if value is _ABSENT:
                    del where[key]
                else:
                    where[key] = value
    if problem:
        raise GraphConfigError(literal(problem))
    if any(key == "fused" for _, key, _ in changes) and not dry_run:
        optimizer._step_supports_amp_scaling = True  # as SGD.__init__ sets it for fused=True
    return [why for _, _, why in changes if why]


_ABSENT = object()


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
