"""``mode=compile``: ``torch.compile(mode="reduce-overhead")``, the baseline a user would
otherwise reach for. Its CUDA graph trees are inductor's own (captured with its own
settings, not ``capture_error_mode``), so this executor runs the step eagerly around
the compiled model.
"""
from __future__ import annotations

import torch

from graphing.executor import Executor, StepRole


class CompiledExecutor(Executor):
    def __init__(self, options, device, ddp_kwargs=None, **kwargs):
        super().__init__(options, device, ddp_kwargs, **kwargs)
        self.report.capture_error_mode = "inductor"  # torch.compile's CUDA graph trees decide

    def wrap_model(self, model, sample_inputs=None, autocast=None):
        self.eval_model = model
        # Compile the DDP module so that DDP's optimizer splits graphs at bucket boundaries.
        return torch.compile(self._ddp(model), mode="reduce-overhead")

    def run(self, role, stage, fn, shape=None):
        # A new input shape is torch.compile's to handle: it records a graph per shape itself.
        if role is StepRole.train:
            torch.compiler.cudagraph_mark_step_begin()  # outputs of the last replay may be overwritten
        super().run(role, stage, fn, shape)
