"""How one training step executes: eager, one CUDA graph per rank, partial graphs, or
torch.compile. Recipes never need to know which.

Graph-safety rules, stated once (PyTorch's CUDA graph notes, torch/cuda/graphs.py):

- DDP is constructed inside the side stream used for warm-up and capture, and runs
  ``graph.warmup_iters`` (>= 11) eager iterations first: it samples runtime stats with
  host syncs and rebuilds its buckets early on. Capture happens on that side stream,
  after a barrier, on every rank.
- ``optimizer.zero_grad(set_to_none=True)`` starts every step, so at capture the
  backward pass allocates ``.grad`` in the graph's pool and replays overwrite it.
- Nothing inside the step synchronizes with the host: no ``.item()``, ``.cpu()``,
  ``print(tensor)`` or tensor-valued ``if``. Metrics accumulate in device tensors that
  the host reads at the log interval.
- Inputs reach the graph through static buffers (or a device-side cursor into a
  device-resident dataset); shapes never change; outputs are overwritten by the next
  replay.
- Optimizers run graph-safe: fused SGD/Adam/AdamW with the learning rate in a device
  tensor, written by the schedule from a device step counter (recipes/optim.py).
- Autocast inside a capture uses ``cache_enabled=False``; bf16 needs no GradScaler.
- Dropout draws fresh numbers on every replay (the default CUDA generator is
  graph-aware).
- Graphs and their memory pool are released (``Executor.close``) before the process
  group is destroyed: a graphed DDP job has been seen to hang at exit otherwise.
- ``torch.compile(mode="default")`` kernels may be captured inside the whole-step graph
  (``graph.compile_model=true``); ``mode="reduce-overhead"`` brings its own graphs and
  is only used on its own (``graph.mode=compile``).
"""
from __future__ import annotations

from graphing.capture import CaptureError
from graphing.executor import Executor
from graphing.options import CAPTURE_ERROR_MODES, DDP_MIN_WARMUP, resolve_mode
from graphing.timing import StepTimer


def build_executor(cfg_graph, rt, mode: str) -> Executor:
    """The executor for a resolved ``mode`` (see ``resolve_mode``)."""
    if mode == "eager":
        return Executor(cfg_graph, rt)
    if mode == "full":
        from graphing.whole_step import WholeStepGraphExecutor
        return WholeStepGraphExecutor(cfg_graph, rt)
    if mode == "partial":
        from graphing.partial import PartialGraphExecutor
        return PartialGraphExecutor(cfg_graph, rt)
    if mode == "compile":
        from graphing.compiled import CompiledExecutor
        return CompiledExecutor(cfg_graph, rt)
    raise ValueError(f"unknown graph mode {mode!r}")


__all__ = ["CAPTURE_ERROR_MODES", "DDP_MIN_WARMUP", "CaptureError", "Executor", "StepTimer",
           "build_executor", "resolve_mode"]
