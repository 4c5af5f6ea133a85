"""``graph.mode=full``: the whole training step (forward, loss, backward, DDP
all-reduce, clipping, optimizer step, LR update, metric accumulation) as one CUDA
graph per rank and per input shape, and evaluation as forward-only graphs, all in one
memory pool.

Several shapes (a last partial batch, sequence-length buckets, a user's loop that
meets a few batch sizes): each shape the caller names gets its own graph, up to
``max_graphs`` per role; graphing/shapes.py decides when each is captured (after the
step's ``warmup_iters``, what DDP needs, and ``shape_warmup_iters`` calls at the shape).

Why one shared pool is safe in any replay order: graphs replay one at a time, on one
stream, and none reads memory that another graph allocated. Everything a graph leaves
for later (gradients the optimizer reads, the metric sums, the learning-rate tensor,
optimizer and loss-scale state) either exists before the first capture, made by the
eager warm-up outside the pool, or is written and consumed within one replay (a graph's
own activations and gradients). What a graph returns to its caller is kept referenced
for the graph's life, so no later capture is given its memory (GraphedStep keeps each
graph's outputs). A block that a graph only uses within its replay may be handed to the
next capture: the two graphs then share it, one after the other, which is the point of
the shared pool (tests/test_shapes_gpu.py replays shapes in random order against eager).
"""
from __future__ import annotations

import gc
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from graphing.capture import capture, pool_mib, reset_rng_capture_state, run_on_stream
from graphing.executor import Executor, GraphRecord, Shape, StepRole, distributed
from graphing.float8_scales import STALE_SCALES, ScaleWatch
from graphing.options import literal
from graphing.shapes import ShapeBook
from graphing.sharded import is_sharded, sharded_units


class FullGraphExecutor(Executor):
    captures_optimizer = True

    def __init__(self, options, device, ddp_kwargs=None, **kwargs):
        super().__init__(options, device, ddp_kwargs, **kwargs)
        self.side = torch.cuda.Stream(device=self.device)  # warm-up, DDP construction and capture all run here
        # One graph per (role, shape), all in one memory pool (see the module docstring).
        self.graphs: Dict[Tuple[StepRole, Shape], torch.cuda.CUDAGraph] = {}
        self.book = ShapeBook(options, ddp=distributed())  # which shape is captured when (graphing/shapes.py)
        self.train_model: Optional[torch.nn.Module] = None  # what the captured step calls (DDP-wrapped)
        self.pool = None
        self.fallen_back = False
        self.report._compile_model = options.compile_model  # only for ExecutionReport.compile_model, deprecated
        self.report.capture_error_mode = options.capture_error_mode

    def wrap_model(self, model, sample_inputs=None, autocast=None):
        if self.options.compile_model:
            # Kernels from torch.compile(mode="default") are captured like any other:
            # fewer, fused kernels inside the graph. Not "reduce-overhead", whose own
            # CUDA graphs cannot nest inside this capture. dynamic=False: each input
            # shape compiles its own static kernels (each shape has its own graph anyway).
            _allow_recompiles(self.options.max_graphs)
            if is_sharded(model):
                compile_sharded_units(model, self.options.compile_mode)
            else:
                model = torch.compile(model, mode=self.options.compile_mode, dynamic=False)
        self.eval_model = model
        self.train_model = run_on_stream(lambda: self._ddp(model), self.side)
        return self.train_model

    def wrap_output_fn(self, fn):
        # Compiled too when the model is: the loss and the metrics read the whole output (a
        # language model's logits: batch x context x vocabulary); fused kernels read it once.
        return torch.compile(fn, mode=self.options.compile_mode, dynamic=False) if self.options.compile_model else fn

    def phase(self, role: StepRole, shape: Shape = None) -> str:
        if (role, shape) in self.graphs:
            return "graph"
        return "eager" if self.fallen_back else self.book.phase(role, shape)

    def run(self, role: StepRole, stage: Callable[[], None], fn: Callable[[], None], shape: Shape = None) -> None:
        self._check_open()
        graph = self.graphs.get((role, shape))
        if graph is not None:
            stage()
            graph.replay()
            return
        if self.book.meet(role, shape):
            self.report.eager_shapes.append(f"{role.value}@{shape}")
        stage()
        if self.fallen_back or not self.book.capture_now(role, shape):
            run_on_stream(fn, self.side)
        elif self._capture(role, shape, fn):
            self.graphs[role, shape].replay()  # capture records but does not run: run this step now
        else:
            self.book.failed_capture(role)
            run_on_stream(fn, self.side)

    def _capture(self, role: StepRole, shape: Shape, fn: Callable[[], None]) -> bool:
        # Every rank captures its own graph, and a collective captured on one rank must
        # be captured on all: meet first, so no rank is still warming up.
        if distributed():
            dist.barrier()
        reshard_units(self.eval_model)
        torch.cuda.synchronize()
        with ScaleWatch(self.eval_model) as scales:  # float8 scales the step assigns itself (graphing/float8_scales.py)
            graph, seconds, failure = capture(fn, self.side, self.pool, self.options.capture_error_mode)
        find_the_line = lambda: self._find_the_line(fn)  # noqa: E731
        if failure is None and scales.stale:  # captured, but its replays would read the warm-up's scales
            graph.reset()
            graph, failure, find_the_line = None, literal(STALE_SCALES), None
        if failure is not None:  # a rank whose own capture succeeded has nothing to repair
            reset_rng_capture_state(self.side)
        if not self._agree_on_capture(failure, find_the_line):
            scales.put_back()  # those the capture assigned were never computed: the eager steps read these
            self.fallen_back = True
            return False
        self.graphs[role, shape] = graph
        if self.pool is None:
            self.pool = graph.pool()
        self.report.capture_s.setdefault(role, seconds)
        self.report.graph_pool_mib = pool_mib(self.pool)
        self.report.graphs.append(GraphRecord(role, "default" if shape is None else str(shape), seconds,
                                              self.report.graph_pool_mib))
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


def _allow_recompiles(max_graphs: int) -> None:
    """Lets torch.compile keep one compiled version per graphed shape (its default limit is 8
    per function; past it dynamo falls back to eager code, silently slower inside the graph)."""
    import torch._dynamo.config as dynamo

    for name in ("recompile_limit", "cache_size_limit"):  # the name in newer / older torch
        if hasattr(dynamo, name):
            setattr(dynamo, name, max(getattr(dynamo, name), max_graphs + 1))  # +1: eval's forward
            return


def reshard_units(model: Optional[torch.nn.Module]) -> None:
    """Every FSDP2 unit of ``model`` back to its shards before a capture. A unit that is already unsharded skips
    its all-gather: a forward without backward (an evaluation under ``torch.no_grad()``) leaves units built with
    ``reshard_after_forward=False`` unsharded, and a capture right after it would record no all-gather for them
    and replay, every step, the weights of that moment from memory freed after the capture. Resharded, the
    capture gathers what it reads. A unit already sharded is left as it is."""
    for unit in sharded_units(model) if model is not None else []:
        unit.reshard()


def compile_sharded_units(model: torch.nn.Module, mode: str) -> None:
    """Compiles the ``forward`` of each innermost FSDP2 unit of ``model`` (a transformer block),
    in place; FSDP2's hooks, which run around ``forward`` in the module's ``__call__``, stay eager.

    Why not the whole model, as without sharding: dynamo skips FSDP2's hooks inside a compiled
    module (``torch._dynamo.config.skip_fsdp_hooks``) and breaks its graph around each unit, and
    that whole-model compile, captured, trained differently from eager on torch 2.11 (gpt_tiny on
    one H100). One compiled block with its parameters as inputs is what torchtitan runs under
    FSDP2 too. The root unit (embeddings, head) runs eagerly; the loss is compiled apart
    (``wrap_output_fn``). All blocks share one compiled code object, so this compiles once."""
    units = sharded_units(model)
    innermost = [u for u in units if sharded_units(u) == [u]]
    for unit in innermost:  # a model sharded as one unit (no blocks) has its own forward compiled
        unit.forward = torch.compile(unit.forward, mode=mode, dynamic=False)


def __getattr__(name: str):
    """``WholeStepGraphExecutor``, the old name of ``FullGraphExecutor`` (graph mode ``full``), deprecated."""
    if name == "WholeStepGraphExecutor":
        from graphing.deprecation import warn_renamed_once

        warn_renamed_once("graphing.full.WholeStepGraphExecutor", "graphing.full.FullGraphExecutor")
        return FullGraphExecutor
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
