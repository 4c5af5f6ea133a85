"""``graph.mode=partial``: ``torch.cuda.make_graphed_callables`` on the model before DDP.

Forward and backward of the model replay as graphs; the DDP all-reduce, the optimizer
and the rest of the step stay eager. This is the alternative PyTorch's docs give for
when the whole step cannot be captured.
"""
from __future__ import annotations

import torch

from graphing.executor import Executor


class PartialGraphExecutor(Executor):
    mode = "partial"

    def wrap_model(self, model, sample_args, autocast):
        self.eval_model = model  # graphed callables keep the eager forward for eval mode
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), autocast():
            graphed = torch.cuda.make_graphed_callables(
                model, tuple(a.detach() for a in sample_args), num_warmup_iters=self.warmup_iters)
        torch.cuda.current_stream().wait_stream(side)
        model.zero_grad(set_to_none=True)  # the warm-up passes left gradients behind
        return self._ddp(graphed)

    def phase(self, role: str) -> str:
        return "graph" if role == "train" else "eager"
