"""How one training step executes: eager, one CUDA graph per rank, partial graphs, or
torch.compile. A library for any DDP loop: it imports only torch, torch.distributed and
the standard library. The trainer uses it through ``build_executor``; your own loop can
use ``GraphedStep`` (see graphing/graphed_step.py and scripts/own_loop.py), with the small
tools such a loop needs inside a graph: ``RunningMeans`` (metrics on the device, read once
per log interval) and ``micro_batches`` (gradient accumulation with DDP's ``no_sync``).

The contract is typed: modes are ``GraphMode`` members, steps are chosen by ``StepRole``
(train, eval: each its own graphs, one per input shape, all in one memory pool), an executor's
``report`` is an ``ExecutionReport``. Errors name graphing's own settings (``mode``, ``on_failure``, ...);
a caller with its own names for them words the message with ``.render(name)``.

Graph-safety rules, stated once (PyTorch's CUDA graph notes, torch/cuda/graphs.py):

- DDP is constructed inside the side stream used for warm-up and capture, and runs
  ``warmup_iters`` (>= 11) eager iterations first: it samples runtime stats with
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
- Gradient clipping: ``torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)``
  returns the norm as a device tensor and scales on the device; ``error_if_nonfinite=True``
  would read the norm on the host, so it stays False.
- Optimizers run graph-safe: capturable/fused, with the learning rate in a device
  tensor that a device-side schedule rewrites in place (graphing/optimizers.py says
  which classes qualify).
- Autocast inside a capture uses ``cache_enabled=False``; bf16 needs no GradScaler.
- Dropout draws fresh numbers on every replay (the default CUDA generator is
  graph-aware).
- Graphs and their memory pool are released (``Executor.close``) before the process
  group is destroyed: a graphed DDP job has been seen to hang at exit otherwise.
- ``torch.compile(mode="default")`` kernels may be captured inside the whole-step graph
  (``compile_model=True``); ``mode="reduce-overhead"`` brings its own graphs and
  is only used on its own (``mode="compile"``).
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.2.0"  # pyproject.toml reads it from here; CHANGELOG.md says what each version changed

from graphing.options import (DDP_MIN_WARMUP, CaptureErrorMode, CompileMode, GraphConfigError, GraphMode,
                              GraphOptions, OnCaptureFailure, SettingMessage)

# The rest loads torch: imported on first use, so that `graphing.options` (the choices,
# which conf/schema.py types its settings with) stays free of torch. The same names are
# imported under TYPE_CHECKING, so that tools and go-to-definition see where they live.
if TYPE_CHECKING:
    from graphing.accumulation import micro_batches, no_sync_except_last
    from graphing.capture import CaptureError, outside_capture
    from graphing.doctor import diagnose
    from graphing.doctor.report import DoctorReport
    from graphing.executor import ExecutionReport, Executor, StepRole
    from graphing.factory import build_executor
    from graphing.graphed_step import GraphedStep
    from graphing.metrics import RunningMeans
    from graphing.optimizers import (closure_problem, float_learning_rate, graph_safe_optimizer_kwargs,
                                     optimizer_capture_problem)
    from graphing.digest import weights_digest
    from graphing.timing import StepTimer

_LAZY = {
    "CaptureError": "graphing.capture",
    "DoctorReport": "graphing.doctor.report",
    "ExecutionReport": "graphing.executor",
    "Executor": "graphing.executor",
    "GraphedStep": "graphing.graphed_step",
    "RunningMeans": "graphing.metrics",
    "StepRole": "graphing.executor",
    "StepTimer": "graphing.timing",
    "build_executor": "graphing.factory",
    "diagnose": "graphing.doctor",
    "closure_problem": "graphing.optimizers",
    "float_learning_rate": "graphing.optimizers",
    "graph_safe_optimizer_kwargs": "graphing.optimizers",
    "micro_batches": "graphing.accumulation",
    "no_sync_except_last": "graphing.accumulation",
    "optimizer_capture_problem": "graphing.optimizers",
    "outside_capture": "graphing.capture",
    "weights_digest": "graphing.digest",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'graphing' has no attribute {name!r}")


__all__ = ["DDP_MIN_WARMUP", "CaptureErrorMode", "CompileMode", "GraphConfigError", "GraphMode", "GraphOptions",
           "OnCaptureFailure", "SettingMessage", *_LAZY]
