"""``graph.mode=compile``: ``torch.compile(mode="reduce-overhead")``, the baseline a user
would otherwise reach for. Its CUDA graph trees are managed by torch.compile itself,
so this executor runs the step eagerly around the compiled model.
"""
from __future__ import annotations

import torch

from graphing.executor import Executor


class CompiledExecutor(Executor):
    mode = "compile"

    def wrap_model(self, model, sample_args, autocast):
        self.eval_model = model
        # Compile the DDP module so that DDP's optimizer splits graphs at bucket boundaries.
        return torch.compile(self._ddp(model), mode="reduce-overhead")

    def run(self, role, stage, fn):
        if role == "train":
            torch.compiler.cudagraph_mark_step_begin()  # outputs of the last replay may be overwritten
        super().run(role, stage, fn)
