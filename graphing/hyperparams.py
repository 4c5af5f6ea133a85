"""An optimizer's hyperparameters as a captured step sees them: the lr carried, the rest guarded.

A graph replays kernels; it never reads ``param_groups`` again. So:

- ``lr`` is carried. Each param group's lr lives in one device tensor that the optimizer
  reads (the tensor the user gave, or one made at the first call). Before every call the
  value the loop wrote between calls (a float, as nanoGPT writes it, a torch lr
  scheduler's float, or another tensor) is copied into it in place, and the group shows
  the loop's own value again after the call. So every replay uses the lr the loop set
  last, and what the loop logs is what the graph used.
- momentum is not carried: torch's SGD takes ``momentum`` as a host float on every path, and
  every Adam/AdamW path that captures reads ``betas`` on the host (a tensor beta makes the
  capture fail: checked on torch 2.11, fused, foreach and single-tensor). A scheduler that
  cycles them (OneCycleLR, CyclicLR with ``cycle_momentum=True``) is refused after capture,
  naming the key and the setting, as below.
- every hyperparameter but the lr that the class declares (betas, eps, weight_decay, ...) is
  taken as it is at capture; a change after capture raises at the next call, naming the
  key, instead of being silently ignored.
- a change to the lr *inside* the step function (a new value assigned, or a write into
  the carried tensor in place, as a torch scheduler's ``step()`` does) would run only
  while warming up and capturing, never on a replay: it is refused at the first call, with
  the fix (step the scheduler, or set the lr, between calls). In-place writes are seen
  through the tensor's version counter, which every in-place op advances.
"""
from __future__ import annotations

import sys
from numbers import Number
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from graphing.options import GraphConfigError, literal


def _same(a: Any, b: Any) -> bool:
    """Equal hyperparameter values; tensors by identity (an in-place change is the graph's to read)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    try:
        return bool(a == b)
    except Exception:
        return a is b


class _CarriedLr:
    """One param group's lr, read by the step from a device tensor."""

    def __init__(self, index: int, value: Any, device: torch.device):
        self.index = index
        self.tensor = _device_scalar(value, device)
        self.written: Any = None  # the loop's own value, put back after the call
        self.version = 0  # the tensor's version counter once staged: every in-place write advances it

    @property
    def name(self) -> str:
        return f"optimizer.param_groups[{self.index}]['lr']"

    def stage(self, group: Dict[str, Any]) -> None:
        """Copies the loop's lr into the tensor, on the current stream; the group then shows the tensor."""
        value = self.written = group["lr"]
        if value is not self.tensor:
            if isinstance(value, torch.Tensor):
                self.tensor.copy_(value.detach().reshape(()), non_blocking=True)
            elif isinstance(value, Number):
                self.tensor.fill_(float(value))
            else:
                raise GraphConfigError(literal(f"{self.name} is {value!r}: write a float or a one-element tensor"))
            group["lr"] = self.tensor
        self.version = self.tensor._version

    def change_inside(self, group: Dict[str, Any]) -> Optional[str]:
        """How the step itself changed the lr since ``stage``, or None."""
        if group["lr"] is not self.tensor:
            return f"sets {self.name} (to {_show(group['lr'])})"
        if self.tensor._version != self.version:
            return (f"writes into {self.name} in place (a torch lr scheduler's step() does that: it fills the "
                    "tensor the optimizer reads)")
        return None

    def give_back(self, group: Dict[str, Any]) -> None:
        group["lr"] = self.written


class CarriedHyperparameters:
    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device):
        self.optimizer = optimizer
        self.device = torch.device(device)
        self.carried = [_CarriedLr(i, group["lr"], self.device) for i, group in enumerate(optimizer.param_groups)]
        self._staged = False
        self._captured: Optional[List[Dict[str, Any]]] = None

    @property
    def lrs(self) -> List[torch.Tensor]:
        """Each group's lr tensor, the one the step reads."""
        return [value.tensor for value in self.carried]

    def _pairs(self):
        return zip(self.optimizer.param_groups, self.carried)

    def before_call(self) -> None:
        """Copies each carried value as the loop left it into the tensors the step reads, on the current stream."""
        groups = self.optimizer.param_groups
        if len(groups) != len(self.carried):
            raise GraphConfigError(literal(
                f"the optimizer had {len(self.carried)} param groups at the first call and has {len(groups)} now: a "
                "captured step keeps the groups it was built with; add param groups before the first call"))
        self._check_unchanged()
        for group, value in self._pairs():
            value.stage(group)
        self._staged = True

    def after_call(self) -> Optional[str]:
        """Gives each group the loop's own values back; returns how the step changed a carried value
        itself (see ``refusal``), or None."""
        change = self._change_inside()
        self.restore()
        return change

    def _change_inside(self) -> Optional[str]:
        return next((c for c in (value.change_inside(group) for group, value in self._pairs()) if c), None)

    def line_of_change(self, run: Callable[[], None]) -> Optional[Tuple[str, int]]:
        """Stages the values, runs ``run`` (one more call of the step) with line tracing in user code,
        and returns the file and line after which a carried value had changed, or None."""
        from graphing.doctor.attribution import is_user_file

        found: List[Tuple[str, int]] = []

        def tracer(frame, event, _arg):
            if event != "call" or found or not is_user_file(frame.f_code.co_filename):
                return None
            last = [frame.f_lineno]

            def local(f, ev, _a):
                if found:
                    return None
                if ev in ("line", "return"):
                    if self._change_inside():  # made by the line that ran last (or the one returning)
                        found.append((f.f_code.co_filename, f.f_lineno if ev == "return" else last[0]))
                    last[0] = f.f_lineno
                return local

            return local

        self.before_call()
        previous = sys.gettrace()
        sys.settrace(tracer)
        try:
            run()
        finally:
            sys.settrace(previous)
            self.restore()
        return found[0] if found else None

    @staticmethod
    def refusal(step_name: str, change: str, line: Optional[Tuple[str, int]]) -> GraphConfigError:
        where = f", at {line[0]}:{line[1]}" if line else ""
        return GraphConfigError(literal(
            f"{step_name} {change} inside the step{where}: a graph replays the step without running its Python, "
            "so that change would happen at capture only and the value would stay frozen at what it was then. "
            "Step the scheduler, or set the lr, in your loop between calls (the value is carried into the "
            "graph), not inside the step function"))

    def restore(self) -> None:
        """Gives each group the loop's own values back (after a call, or a call that raised)."""
        if not self._staged:
            return
        for group, value in self._pairs():
            value.give_back(group)
        self._staged = False

    def freeze_the_rest(self) -> None:
        """Called once the step is captured: from now on only the carried values may change."""
        if self._captured is not None:
            return
        self._captured = [{k: v for k, v in group.items() if k in self.optimizer.defaults and k not in ("params", "lr")}
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
                        f"the step was captured: the graph keeps {_show(before)} ({_what_is_carried(key)}). "
                        f"Set '{key}' before the first call, or build a new GraphedStep (close() this one) to "
                        "capture with the new value"))


def _what_is_carried(key: str) -> str:
    if key == "betas":  # OneCycleLR and CyclicLR with cycle_momentum=True cycle beta1 of Adam and AdamW
        return ("only 'lr' is carried: torch's Adam and AdamW read betas as host numbers, in every path that "
                "captures (fused, foreach and single-tensor: a tensor beta syncs with the host, checked on "
                "torch 2.11); with OneCycleLR or CyclicLR set cycle_momentum=False")
    if key == "momentum":
        return ("only 'lr' is carried: torch's SGD takes momentum as a host float on every path; with OneCycleLR "
                "or CyclicLR set cycle_momentum=False")
    return "only 'lr' is carried"


def _device_scalar(value: Any, device: torch.device) -> torch.Tensor:
    """The user's own one-element float device tensor as it is (they may write into it), else a new one."""
    if isinstance(value, torch.Tensor) and value.device == device and value.numel() == 1 and value.is_floating_point():
        return value
    number = value.detach().reshape(()).to(device, torch.float32) if isinstance(value, torch.Tensor) else float(value)
    return torch.tensor(number, dtype=torch.float32, device=device)


def _show(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor ({tuple(value.shape)}, {value.device})"
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(_show(v) for v in value) + ")"
    return repr(value)
