"""lr_frozen: an optimizer's learning rate that changes between steps as a Python number (or is
replaced by a new tensor). A captured step keeps the value, or the tensor, it saw at capture.

Each step's lr is read at its first ``optimizer.step()`` (optimizer_checks.py hooks it); line
tracing (``sys.settrace``, user frames only) finds the line that wrote each new value.
"""
from __future__ import annotations

import os
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from graphing.doctor.attribution import is_user_file
from graphing.doctor.findings import WRONG, Findings


def lr_state(optimizers: Sequence[torch.optim.Optimizer]) -> Tuple:
    """Every param group's lr: a tensor by its identity, a Python number by its value."""
    state = []
    for opt in optimizers:
        for group in opt.param_groups:
            lr = group.get("lr")
            state.append(("tensor", id(lr)) if isinstance(lr, torch.Tensor) else ("number", lr))
    return tuple(state)


class LearningRateWatch:
    def __init__(self, optimizers: Sequence[torch.optim.Optimizer], findings: Findings):
        self.optimizers = list(optimizers)
        self.findings = findings
        self.at_step: List[Optional[Tuple]] = []  # each step's first optimizer.step(): its groups' lr
        self.set_at: Dict[Tuple, Tuple[str, int]] = {}  # an lr state -> the user line that wrote it
        self._last_seen = lr_state(self.optimizers)

    def begin_step(self) -> None:
        self.at_step.append(None)

    def read_at_first_optimizer_step(self) -> bool:
        """Records this step's lr unless an optimizer step already did; True when this one did."""
        if self.at_step[-1] is not None:
            return False
        self.at_step[-1] = lr_state(self.optimizers)
        return True

    def tracer(self, frame, event, arg):
        """A ``sys.settrace`` function: user frames only, each line checked for a changed lr."""
        if event != "call" or not is_user_file(frame.f_code.co_filename):
            return None
        last = [frame.f_lineno]

        def local(f, ev, _arg):
            if ev in ("line", "return"):
                now = lr_state(self.optimizers)
                if now != self._last_seen:
                    line = f.f_lineno if ev == "return" else last[0]
                    self.set_at.setdefault(now, (os.path.abspath(f.f_code.co_filename), line))
                    self._last_seen = now
                last[0] = f.f_lineno
            return local

        return local

    def find_changes(self, call_site: Optional[Tuple[str, int]]) -> None:
        """lr_frozen at the line that wrote the new lr (else where the step calls optimizer.step())."""
        last = len(self.at_step) - 1
        self.findings.step = last if last >= 2 else -1  # dated like step_diff's findings: the last step compared
        self._find_changes(call_site or ("", 0))
        self.findings.step = -1

    def _find_changes(self, site: Tuple[str, int]) -> None:
        seen = [s for s in self.at_step if s is not None]
        for before, after in zip(seen, seen[1:]):
            if before == after:
                continue
            where = self.set_at.get(after, site)
            replaced = any(x[0] == "tensor" and y[0] == "tensor" and x != y for x, y in zip(before, after))
            if replaced:
                what = "an optimizer's lr tensor is replaced by a new tensor between steps: the graph reads the old one"
            else:
                pair = next((x[1], y[1]) for x, y in zip(before, after) if x != y) if len(before) == len(after) \
                    else (None, None)
                what = (f"an optimizer's lr is a Python number that changes between steps ({pair[0]!r} then "
                        f"{pair[1]!r}): the graph keeps the value it had at capture")
            self.findings.add("lr_frozen", WRONG, *where, what)
            return
        for opt in self.optimizers:
            if getattr(opt.step, "_wrapped_by_lr_sched", False) and any(
                    not isinstance(g.get("lr"), torch.Tensor) for g in opt.param_groups):
                self.findings.add("lr_frozen", WRONG, *site,
                                  "a torch.optim.lr_scheduler drives this optimizer's Python-number lr: the graph "
                                  "keeps the value it had at capture")
