"""The checks that watch the eager steps, around one list of findings that each of them adds to.
Everything here works on the CPU as well as on CUDA, except CUDA's own sync detection."""
from __future__ import annotations

import contextlib
from typing import Any, Callable, List, Sequence

import torch

from graphing.doctor.cuda_sync_watch import watch_cuda_syncs
from graphing.doctor.findings import WRONG, Findings
from graphing.doctor.interception import CallInterceptor
from graphing.doctor.lr_tracing import LearningRateWatch
from graphing.doctor.memory import MemoryWatch
from graphing.doctor.model_checks import ddp_finds_unused_parameters, watch_model
from graphing.doctor.optimizer_checks import OptimizerWatch, optimizer_findings
from graphing.doctor.step_diff import StepRecords
from graphing.float8_scales import STALE_SCALES_WHAT, ScaleWatch
from graphing.options import GraphOptions


class EagerChecks:
    def __init__(self, model: torch.nn.Module, device: torch.device, optimizers: Sequence[torch.optim.Optimizer],
                 max_graphs: int = GraphOptions.max_graphs):
        self.model = model
        self.optimizers = list(optimizers)
        self.findings = Findings()
        self.records = StepRecords(self.findings, max_graphs)
        self.memory = MemoryWatch(self.findings, device)
        self.learning_rates = LearningRateWatch(self.optimizers, self.findings)
        self.optimizer_watch = OptimizerWatch(self.optimizers, self.findings, self.learning_rates)
        self.calls = CallInterceptor(device, self.findings, self.records, self.memory)
        self._model_hooks: List[Any] = []
        self._scales = ScaleWatch(None)  # float8 scales the step assigns itself (graphing/float8_scales.py)

    def start(self) -> None:
        self._model_hooks = watch_model(self.model, self.findings)
        self.optimizer_watch.start()
        self.memory.start()

    def stop(self) -> None:
        self.memory.stop()
        self.optimizer_watch.stop()
        for h in self._model_hooks:
            h.remove()
        self._model_hooks.clear()

    def begin_step(self, index: int, inputs: Sequence[Any]) -> None:
        self.findings.step = index
        self.records.begin_step(inputs)
        self.learning_rates.begin_step()
        self._scales = ScaleWatch(self.model).__enter__()

    @contextlib.contextmanager
    def watching(self, cuda_syncs: bool):
        """Around the step itself: its torch calls, and (``cuda_syncs``) what CUDA reports as a sync."""
        syncs = watch_cuda_syncs(self.findings, self.calls, ddp_finds_unused_parameters(self.model)) if cuda_syncs \
            else contextlib.nullcontext()
        with syncs, self.calls:
            yield

    def end_step(self) -> None:
        self._scales.__exit__(None, None, None)
        if self._scales.stale:
            self.findings.add("float8_scales", WRONG, what=STALE_SCALES_WHAT)
        self.findings.step = -1

    def after_steps(self, step_fn: Callable[..., Any], check_optimizer: bool) -> None:
        """What only the steps together show: differences between them, lr changes, kept memory; then the
        optimizers' capturability (``check_optimizer``)."""
        self.records.compare_steps()
        self.learning_rates.find_changes(self.optimizer_watch.call_site)
        self.memory.find_growth(len(self.records.calls) - 1, step_fn)
        if check_optimizer:
            optimizer_findings(self.optimizer_watch, self.findings)
