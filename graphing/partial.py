"""``mode=partial``: ``torch.cuda.make_graphed_callables`` on the model before DDP.

Forward and backward of the model replay as graphs; the DDP all-reduce, the optimizer
and the rest of the step stay eager. This is the alternative PyTorch's docs give for
when the whole step cannot be captured. The graphs hold the shapes of the sample inputs
(the first training batch); a call with other shapes (a last partial batch) runs the
model's own forward and backward eagerly, and is timed as eager.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Tuple

import torch

from graphing.capture import capturing, explain_capture_failure, reset_rng_capture_state, run_on_stream
from graphing.compat import make_graphed_callables_takes_capture_error_mode
from graphing.executor import Executor, Shape, StepRole, is_main_rank

log = logging.getLogger(__name__)


class PartialGraphExecutor(Executor):
    def __init__(self, options, device, ddp_kwargs=None, **kwargs):
        super().__init__(options, device, ddp_kwargs, **kwargs)
        self.graphed_shape: Shape = None  # the caller's name for the shape the graphs hold: the first train one
        self.first_seen = False

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
            with capturing(), (autocast or contextlib.nullcontext)():
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
        else:
            _route_by_shape(model, args)
        model.zero_grad(set_to_none=True)  # the warm-up passes left gradients behind
        return self._ddp(graphed)

    def phase(self, role: StepRole, shape: Shape = None) -> str:
        graphed = self.first_seen is False or shape == self.graphed_shape
        return "graph" if role is StepRole.train and self.report.fallback is None and graphed else "eager"

    def run(self, role, stage, fn, shape: Shape = None) -> None:
        if role is StepRole.train and not self.first_seen:
            self.graphed_shape, self.first_seen = shape, True
        super().run(role, stage, fn, shape)


def _route_by_shape(model: torch.nn.Module, sample: Tuple[torch.Tensor, ...]) -> None:
    """Sends calls whose tensors differ in shape or dtype from ``sample`` to the model's eager
    forward: the graphed forward would copy them into buffers of the sample's shape."""
    graphed_forward = model.forward  # what make_graphed_callables installed on the instance
    eager_forward = type(model).forward.__get__(model)
    layout = [(a.shape, a.dtype) for a in sample]

    def forward(*args):
        same = len(args) == len(layout) and all(
            torch.is_tensor(a) and (a.shape, a.dtype) == want for a, want in zip(args, layout))
        return graphed_forward(*args) if same else eager_forward(*args)

    model.forward = forward
