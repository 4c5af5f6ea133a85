"""An optimizer's hyperparameters as a captured step sees them: the lr carried, the rest guarded.

A graph replays kernels; it never reads ``param_groups`` again. So:

- ``lr`` is carried. Each param group's lr lives in one device tensor that the optimizer
  reads (the tensor the user gave, or one made at the first call). Before every call the
  value the loop wrote between calls (a float, as nanoGPT writes it, a torch lr
  scheduler's float, or another tensor) is copied into it in place, and the group shows
  the loop's own value again after the call. So every replay uses the lr the loop set
  last, and what the loop logs is what the graph used.
- every other hyperparameter the class declares (betas, eps, weight_decay, momentum, ...)
  is taken as it is at capture; a change after capture raises at the next call, naming
  the key, instead of being silently ignored.
- a write into ``lr`` *inside* the step function runs only while warming up and capturing,
  never on a replay: it is refused at the first call, with the line to move.
"""
from __future__ import annotations

from numbers import Number
from typing import Any, Dict, List, Optional

import torch

from graphing.options import GraphConfigError, literal

_NOT_GUARDED = ("params", "lr")


def _same(a: Any, b: Any) -> bool:
    """Equal hyperparameter values; tensors by identity (an in-place change is the graph's to read)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    try:
        return bool(a == b)
    except Exception:
        return a is b


class CarriedHyperparameters:
    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device):
        self.optimizer = optimizer
        self.device = torch.device(device)
        self.lrs: List[torch.Tensor] = [self._lr_tensor(group["lr"]) for group in optimizer.param_groups]
        self._written: List[Any] = []  # the loop's own value of each group's lr, put back after the call
        self._captured: Optional[List[Dict[str, Any]]] = None

    def _lr_tensor(self, lr: Any) -> torch.Tensor:
        if isinstance(lr, torch.Tensor) and lr.device == self.device and lr.numel() == 1 and lr.is_floating_point():
            return lr  # the user's own device tensor: they may keep writing into it in place
        value = lr.detach().reshape(()).to(self.device, torch.float32) if isinstance(lr, torch.Tensor) else float(lr)
        return torch.tensor(value, dtype=torch.float32, device=self.device)

    def before_call(self) -> None:
        """Copies each group's lr as the loop left it into the tensor the step reads, on the current stream."""
        groups = self.optimizer.param_groups
        if len(groups) != len(self.lrs):
            raise GraphConfigError(literal(
                f"the optimizer had {len(self.lrs)} param groups at the first call and has {len(groups)} now: a "
                "captured step keeps the groups it was built with; add param groups before the first call"))
        self._check_unchanged()
        self._written = []
        for group, carried in zip(groups, self.lrs):
            value = group["lr"]
            self._written.append(value)
            if value is carried:
                continue
            if isinstance(value, torch.Tensor):
                carried.copy_(value.detach().reshape(()), non_blocking=True)
            elif isinstance(value, Number):
                carried.fill_(float(value))
            else:
                raise GraphConfigError(literal(f"param_groups[{len(self._written) - 1}]['lr'] is {value!r}: "
                                               "write a float or a one-element tensor"))
            group["lr"] = carried

    def after_call(self, step_name: str = "the step function") -> None:
        """Gives each group the loop's own lr back; refuses a step that wrote an lr itself."""
        for i, (group, carried, written) in enumerate(zip(self.optimizer.param_groups, self.lrs, self._written)):
            if group["lr"] is not carried:
                new = group["lr"]
                group["lr"] = written
                raise GraphConfigError(literal(
                    f"{step_name} sets optimizer.param_groups[{i}]['lr'] (to {_show(new)}) inside the step: a "
                    "graph replays the step without running its Python, so that write would happen at capture "
                    "only and the lr would stay frozen. Set the lr in your loop before calling the step (it is "
                    "carried into the graph), or write into a device tensor lr in place"))
            group["lr"] = written

    def restore(self) -> None:
        """Gives each group the loop's own lr back (after a call that raised)."""
        for group, written in zip(self.optimizer.param_groups, self._written):
            group["lr"] = written

    def freeze_the_rest(self) -> None:
        """Called once the step is captured: from now on only ``lr`` may change."""
        if self._captured is not None:
            return
        self._captured = [{k: v for k, v in group.items() if k in self.optimizer.defaults and k not in _NOT_GUARDED}
                          for group in self.optimizer.param_groups]

    def _check_unchanged(self) -> None:
        if self._captured is None:
            return
        for i, (group, captured) in enumerate(zip(self.optimizer.param_groups, self._captured)):
            for key, before in captured.items():
                now = group.get(key)
                if not _same(now, before):
                    raise GraphConfigError(literal(
                        f"optimizer.param_groups[{i}]['{key}'] changed from {_show(before)} to {_show(now)} after "
                        f"the step was captured: the graph keeps {_show(before)} (only 'lr' is carried into it). "
                        f"Set '{key}' before the first call, or build a new GraphedStep (close() this one) to "
                        "capture with the new value"))


def _show(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor ({tuple(value.shape)}, {value.device})"
    return repr(value)
