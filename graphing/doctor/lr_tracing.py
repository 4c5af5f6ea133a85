"""lr_frozen: an optimizer's learning rate written *inside* the step (a Python number, or a new
tensor in the group). A replay runs no Python, so that write happens at capture only: the graph
keeps the value it saw then, and GraphedStep refuses such a step at its first call.

Written between steps (the loop sets ``group["lr"]`` before calling the step, as nanoGPT does, or
steps a torch lr scheduler there), the lr is no finding: GraphedStep carries it into the graph
(graphing/hyperparams.py). Each step's lr is read at its first ``optimizer.step()``
(optimizer_checks.py hooks it); line tracing (``sys.settrace``, user frames only) finds the line
that wrote each new value, and whether it ran inside the step.
"""
from __future__ import annotations

import os
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from graphing.doctor.attribution import is_user_file
from graphing.doctor.findings import BLOCKS, Findings


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
        self.set_at: Dict[Tuple, Tuple[str, int, bool]] = {}  # lr state -> (file, line, inside the step)
        self.inside_step = False  # set by the doctor while the step itself runs
        self.carried = False  # the lr changed between steps: GraphedStep carries that
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
                    self.set_at.setdefault(now, (os.path.abspath(f.f_code.co_filename), line, self.inside_step))
                    self._last_seen = now
                last[0] = f.f_lineno
            return local

        return local

    def find_changes(self, call_site: Optional[Tuple[str, int]]) -> None:
        """lr_frozen at the line inside the step that wrote the new lr (else where the step calls
        optimizer.step())."""
        last = len(self.at_step) - 1
        self.findings.step = last if last >= 2 else -1  # dated like step_diff's findings: the last step compared
        self._find_changes(call_site or ("", 0))
        self.findings.step = -1

    def _find_changes(self, site: Tuple[str, int]) -> None:
        seen = [s for s in self.at_step if s is not None]
        for before, after in zip(seen, seen[1:]):
            if before == after:
                continue
            file, line, inside = self.set_at.get(after, (*site, False))
            if not inside:
                self.carried = True  # written by the loop between calls: carried into the graph
                continue
            replaced = any(x[0] == "tensor" and y[0] == "tensor" and x != y for x, y in zip(before, after))
            if replaced:
                what = ("the step puts a new tensor into an optimizer's lr: a graph replays without running that "
                        "write and reads the tensor it was captured with (GraphedStep refuses it)")
            else:
                pair = next((x[1], y[1]) for x, y in zip(before, after) if x != y) if len(before) == len(after) \
                    else (None, None)
                what = (f"the step writes an optimizer's lr as a Python number ({pair[0]!r} then {pair[1]!r}): a "
                        "graph replays without running that write and keeps the lr of the capture (GraphedStep "
                        "refuses it)")
            self.findings.add("lr_frozen", BLOCKS, file, line, what)
            return
