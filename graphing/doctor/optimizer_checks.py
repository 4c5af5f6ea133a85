"""The optimizers: where the user's step calls ``optimizer.step()``, and whether a capture accepts
the optimizer (optimizer: capturable or fused on CUDA, as GraphedStep and the trainer require)."""
from __future__ import annotations

import sys
from typing import Any, List, Optional, Sequence, Tuple

import torch

from graphing.doctor.attribution import user_site
from graphing.doctor.findings import BLOCKS, FIXES, Findings, place_of
from graphing.doctor.lr_tracing import LearningRateWatch
from graphing.optimizers import optimizer_capture_problem


class OptimizerWatch:
    """Hooks each optimizer's step: reads the lr once a step, and finds the line that calls it."""

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer], findings: Findings,
                 learning_rates: LearningRateWatch):
        self.optimizers = list(optimizers)
        self.findings = findings
        self.learning_rates = learning_rates
        self.call_site: Optional[Tuple[str, int]] = None
        self._hooks: List[Any] = []

    def start(self) -> None:
        for opt in self.optimizers:
            self._hooks.append(opt.register_step_pre_hook(self._before_step))

    def stop(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def _before_step(self, optimizer, args, kwargs) -> None:
        if self.findings.step < 0 or not self.learning_rates.read_at_first_optimizer_step():
            return
        if self.call_site is None:
            frame, _ = user_site(sys._getframe(1))
            if frame is not None:
                self.call_site = place_of(frame)


def optimizer_findings(optimizers: Sequence[torch.optim.Optimizer], findings: Findings,
                       call_site: Optional[Tuple[str, int]]) -> None:
    """Optimizers whose step a capture refuses or would freeze; GraphedStep and the trainer refuse them too."""
    for opt in optimizers:
        problem = optimizer_capture_problem(opt)
        if not problem:
            continue
        has_mode = any("capturable" in g for g in opt.param_groups)
        fix = FIXES["optimizer"] if has_mode else ("Use an optimizer class with a capturable or fused CUDA mode "
                                                   "(SGD, Adam, AdamW, RMSprop, ...).")
        findings.add("optimizer", BLOCKS, *(call_site or ("", 0)), problem.split(";")[0], fix)
