"""The optimizers: where the user's step calls ``optimizer.step()``, and whether a capture accepts
the optimizer as GraphedStep would take it: judged as the user handed it over, before the checked
steps make its state. On CUDA the doctor makes it graph-safe the way GraphedStep does
(``make_graph_safe``: capturable, fused SGD), so that its capture attempt is GraphedStep's."""
from __future__ import annotations

import sys
from typing import Any, List, Optional, Sequence, Tuple

import torch

from graphing.doctor.attribution import user_site
from graphing.doctor.findings import BLOCKS, FIXES, Findings, place_of
from graphing.doctor.lr_tracing import LearningRateWatch
from graphing.optimizers import make_graph_safe
from graphing.options import GraphConfigError


class OptimizerWatch:
    """Hooks each optimizer's step: reads the lr once a step, and finds the line that calls it."""

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer], findings: Findings,
                 learning_rates: LearningRateWatch):
        self.optimizers = list(optimizers)
        self.findings = findings
        self.learning_rates = learning_rates
        self.call_site: Optional[Tuple[str, int]] = None
        self.problems: List[Tuple[torch.optim.Optimizer, str]] = []  # what GraphedStep would refuse
        self.made_safe: List[str] = []  # what was changed, as GraphedStep changes it (CUDA)
        self._hooks: List[Any] = []

    def prepare(self, apply: bool) -> None:
        """Judges each optimizer as handed over; with ``apply``, changes it as GraphedStep would."""
        for opt in self.optimizers:
            try:
                self.made_safe += make_graph_safe(opt, dry_run=not apply)
            except GraphConfigError as refused:
                self.problems.append((opt, str(refused)))

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


def optimizer_findings(watch: OptimizerWatch, findings: Findings) -> None:
    """Optimizers whose step a capture refuses or would freeze, even after GraphedStep's changes."""
    for opt, problem in watch.problems:
        has_mode = any("capturable" in g for g in opt.param_groups)
        fix = FIXES["optimizer"] if has_mode else ("Use an optimizer class with a capturable or fused CUDA mode "
                                                   "(SGD, Adam, AdamW, RMSprop, ...).")
        findings.add("optimizer", BLOCKS, *(watch.call_site or ("", 0)), problem.split(":")[0].split(";")[0], fix)
