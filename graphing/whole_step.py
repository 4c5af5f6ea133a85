"""``graph.mode=full``: the whole training step (forward, loss, backward, DDP
all-reduce, clipping, optimizer step, LR update, metric accumulation) as one CUDA
graph per rank, and evaluation as a forward-only graph sharing its memory pool.
"""
from __future__ import annotations

import gc
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from graphing.capture import capture, pool_mib, reset_rng_capture_state, run_on_stream
from graphing.executor import Executor, StepRole, distributed


class WholeStepGraphExecutor(Executor):
    captures_optimizer = True

    def __init__(self, options, device, ddp_kwargs=None, **kwargs):
        super().__init__(options, device, ddp_kwargs, **kwargs)
        self.side = torch.cuda.Stream(device=self.device)  # warm-up, DDP construction and capture all run here
        # One graph per role, all in one memory pool (eval's replays never overlap train's).
        self.graphs: Dict[StepRole, torch.cuda.CUDAGraph] = {}
        self.train_model: Optional[torch.nn.Module] = None  # what the captured step calls (DDP-wrapped)
        self.pool = None
        self.fallen_back = False
        # Eager calls before capture: train needs DDP's warm-up; eval needs one pass to
        # settle cuDNN/compile for the eval batch shape.
        self.eager_before = {StepRole.train: self.warmup_iters + options.eager_steps_before_capture,
                             StepRole.eval: 1}
        self.report.compile_model = options.compile_model
        self.report.capture_error_mode = options.capture_error_mode

    def wrap_model(self, model, sample_inputs=None, autocast=None):
        if self.options.compile_model:
            # Kernels from torch.compile(mode="default") are captured like any other:
            # fewer, fused kernels inside the graph. Not "reduce-overhead", whose own
            # CUDA graphs cannot nest inside this capture.
            model = torch.compile(model, mode="default")
        self.eval_model = model
        self.train_model = run_on_stream(lambda: self._ddp(model), self.side)
        return self.train_model

    def wrap_output_fn(self, fn):
        # Compiled too when the model is: the loss and the metrics read the whole output (a
        # language model's logits: batch x context x vocabulary); fused kernels read it once.
        return torch.compile(fn, mode="default") if self.options.compile_model else fn

    def phase(self, role: StepRole) -> str:
        if role in self.graphs:
            return "graph"
        n = self.calls[role]
        if self.fallen_back:
            return "eager"
        if n >= self.eager_before[role]:
            return "capture"  # what run() does next, whatever the warm-up count (eval captures early)
        return "warmup" if n < self.warmup_iters else "eager"

    def run(self, role: StepRole, stage: Callable[[], None], fn: Callable[[], None]) -> None:
        self._check_open()
        graph = self.graphs.get(role)
        if graph is not None:
            stage()
            graph.replay()
            return
        n = self.calls[role]
        self.calls[role] += 1
        stage()
        if self.fallen_back or n < self.eager_before[role]:
            run_on_stream(fn, self.side)
            return
        if self._capture(role, fn):
            self.graphs[role].replay()  # capture records but does not run: run this step now
        else:
            run_on_stream(fn, self.side)

    def _capture(self, role: StepRole, fn: Callable[[], None]) -> bool:
        # Every rank captures its own graph, and a collective captured on one rank must
        # be captured on all: meet first, so no rank is still warming up.
        if distributed():
            dist.barrier()
        torch.cuda.synchronize()
        graph, seconds, failure = capture(fn, self.side, self.pool, self.options.capture_error_mode)
        if failure is not None:  # a rank whose own capture succeeded has nothing to repair
            reset_rng_capture_state(self.side)
        if not self._agree_on_capture(failure, lambda: self._find_the_line(fn)):
            self.fallen_back = True
            return False
        self.graphs[role] = graph
        if self.pool is None:
            self.pool = graph.pool()
        self.report.capture_s[role] = seconds
        self.report.graph_pool_mib = pool_mib(self.pool)
        return True

    def _find_the_line(self, fn: Callable[[], None]) -> List[str]:
        """The doctor's checks over one more eager step (every rank: its collectives must match)."""
        from graphing.doctor.one_step import blocking_findings, describe

        model = next((m for m in (self.train_model, self.eval_model) if m is not None),
                     torch.nn.Module())  # an executor driven without wrap_model has no model to watch
        return describe(blocking_findings(fn, model, self.device, self.side))

    def close(self) -> None:
        # Graphs hold a private memory pool and captured NCCL work: release them before the
        # process group goes, or a graphed DDP job can hang at exit.
        super().close()
        if not self.graphs:
            return
        torch.cuda.synchronize()
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.pool = None
        gc.collect()
        torch.cuda.empty_cache()
