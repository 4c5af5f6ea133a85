"""``graph.mode=full``: the whole training step (forward, loss, backward, DDP
all-reduce, clipping, optimizer step, LR update, metric accumulation) as one CUDA
graph per rank, and evaluation as a forward-only graph sharing its memory pool.
"""
from __future__ import annotations

import gc
from typing import Callable, Dict

import torch
import torch.distributed as dist

from graphing.capture import capture, pool_mib, reset_rng_capture_state
from graphing.executor import Executor, distributed



class WholeStepGraphExecutor(Executor):
    captures_optimizer = True

    def __init__(self, options, device, ddp_kwargs=None):
        super().__init__(options, device, ddp_kwargs)
        self.side = torch.cuda.Stream(device=self.device)  # warm-up, DDP construction and capture all run here
        self.graphs: Dict[str, torch.cuda.CUDAGraph] = {}
        self.pool = None
        self.fallen_back = False
        # Eager calls before capture: train needs DDP's warm-up; eval needs one pass to
        # settle cuDNN/compile for the eval batch shape.
        self.eager_before = {"train": self.warmup_iters + options.eager_steps_before_capture, "eval": 1}
        self.info.update(compile_model=options.compile_model, capture_error_mode=options.capture_error_mode)

    def wrap_model(self, model, sample_inputs=None, autocast=None):
        if self.options.compile_model:
            # Kernels from torch.compile(mode="default") are captured like any other:
            # fewer, fused kernels inside the graph. Not "reduce-overhead", whose own
            # CUDA graphs cannot nest inside this capture.
            model = torch.compile(model, mode="default")
        self.eval_model = model
        self.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side):
            wrapped = self._ddp(model)
        torch.cuda.current_stream().wait_stream(self.side)
        return wrapped

    def wrap_output_fn(self, fn):
        # Compiled too when the model is: the loss and the metrics read the whole output (a
        # language model's logits: batch x context x vocabulary); fused kernels read it once.
        return torch.compile(fn, mode="default") if self.options.compile_model else fn

    def phase(self, role: str) -> str:
        if role in self.graphs:
            return "graph"
        n = self.calls[role]
        if self.fallen_back:
            return "eager"
        if n >= self.eager_before[role]:
            return "capture"  # what run() does next, whatever the warm-up count (eval captures early)
        return "warmup" if n < self.warmup_iters else "eager"

    def run(self, role: str, stage: Callable[[], None], fn: Callable[[], None]) -> None:
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
            self._on_side_stream(fn)
            return
        if self._capture(role, fn):
            self.graphs[role].replay()  # capture records but does not run: run this step now
        else:
            self._on_side_stream(fn)

    def _on_side_stream(self, fn: Callable[[], None]) -> None:
        current = torch.cuda.current_stream()
        self.side.wait_stream(current)
        with torch.cuda.stream(self.side):
            fn()
        current.wait_stream(self.side)

    def _capture(self, role: str, fn: Callable[[], None]) -> bool:
        # Every rank captures its own graph, and a collective captured on one rank must
        # be captured on all: meet first, so no rank is still warming up.
        if distributed():
            dist.barrier()
        torch.cuda.synchronize()
        graph, seconds, failure = capture(fn, self.side, self.pool, self.options.capture_error_mode,
                                           self.options.setting_prefix)
        if failure is not None:  # a rank whose own capture succeeded has nothing to repair
            reset_rng_capture_state(self.side)
        if not self._agree_on_capture(failure):
            self.fallen_back = True
            return False
        self.graphs[role] = graph
        if self.pool is None:
            self.pool = graph.pool()
        self.info[f"{role}_capture_s"] = seconds
        self.info["graph_pool_mib"] = pool_mib(self.pool)
        return True

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
