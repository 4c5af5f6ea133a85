"""``mode=partial``: ``torch.cuda.make_graphed_callables`` on the model before DDP.

Forward and backward of the model replay as graphs; the DDP all-reduce, the optimizer
and the rest of the step stay eager. This is the alternative PyTorch's docs give for
when the whole step cannot be captured.
"""
from __future__ import annotations

import contextlib
import logging

import torch

from graphing.capture import explain_capture_failure, reset_rng_capture_state, run_on_stream
from graphing.compat import make_graphed_callables_takes_capture_error_mode
from graphing.executor import Executor, StepRole, is_main_rank

log = logging.getLogger(__name__)


class PartialGraphExecutor(Executor):
    def wrap_model(self, model, sample_inputs=None, autocast=None):
        if sample_inputs is None:
            raise ValueError("mode=partial traces the model ahead of time: pass sample_inputs to wrap_model")
        self.eval_model = model  # graphed callables keep the eager forward for eval mode
        kwargs = {}
        wanted = self.options.capture_error_mode
        if make_graphed_callables_takes_capture_error_mode():
            kwargs["capture_error_mode"] = wanted
            self.report.capture_error_mode = wanted
        else:  # this torch captures with its default, "global"
            self.report.capture_error_mode = "global"
            if wanted != "global" and is_main_rank():
                log.warning("capture_error_mode=%s is ignored in mode=partial: torch %s's "
                            "make_graphed_callables has no capture_error_mode and captures with 'global'",
                            wanted, torch.__version__)
        args = tuple(a.detach() for a in sample_inputs())
        side = torch.cuda.Stream(device=self.device)

        def make_graphed():
            with (autocast or contextlib.nullcontext)():
                return torch.cuda.make_graphed_callables(model, args, num_warmup_iters=self.warmup_iters, **kwargs)

        graphed, failure = None, None
        try:
            graphed = run_on_stream(make_graphed, side)
        except Exception as err:
            # A failed capture leaves the CUDA generator in capture mode: every later random
            # op would fail, so repair it before going on.
            torch.cuda.synchronize(self.device)
            reset_rng_capture_state(side)
            failure = explain_capture_failure(err, self.report.capture_error_mode)
        if not self._agree_on_capture(failure):
            graphed = model
        model.zero_grad(set_to_none=True)  # the warm-up passes left gradients behind
        return self._ddp(graphed)

    def phase(self, role: StepRole) -> str:
        return "graph" if role is StepRole.train and self.report.fallback is None else "eager"
