"""``GraphedStep``: graph the training step of your own loop, with no config system.

    model = Net().cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3, device="cuda"),
                                  **graphing.graph_safe_optimizer_kwargs(torch.optim.AdamW, "cuda", {}))

    def train_step(model, x, y):               # model: what GraphedStep built (DDP under torchrun)
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        return loss.detach()                   # outputs: device tensors, no .item() here

    step = graphing.GraphedStep(train_step, model, optimizer, capture_error_mode="thread_local")
    for x, y in loader:
        loss = step(x, y)                      # copies x, y into static buffers, then runs the step
    step.close()                               # before dist.destroy_process_group()

What happens: the first ``warmup_iters`` calls (11, what DDP needs) run eagerly on a side
stream, where DDP was also built; then all ranks meet, each captures its own graph
with ``capture_error_mode``, and they agree on the outcome: every rank replays, or every
rank stops with the reason (``on_failure="fail"``) or goes on eagerly (``"eager"``).
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Dict, Optional, Sequence

import torch
import torch.distributed as dist

from graphing.executor import ExecutionReport, Executor, StepRole, is_main_rank
from graphing.factory import build_executor
from graphing.optimizers import float_learning_rate, optimizer_capture_problem
from graphing.options import STEP_MODES, GraphConfigError, GraphMode, GraphOptions

log = logging.getLogger(__name__)


class GraphedStep:
    """Runs ``step_fn(model, *inputs)`` eagerly for warm-up, then as one CUDA graph per rank.

    ``step_fn`` must be graph-safe: static shapes, no host syncs (``.item()``, ``.cpu()``,
    ``print(tensor)``, a tensor in an ``if``), a tensor learning rate if it is to change.
    Each call copies its tensor arguments into static device buffers made at the first
    call (later calls must bring the same shapes and dtypes) and returns what
    ``step_fn`` returned: in graph phase the same tensors every time, overwritten by the
    next call, so clone what you keep.

    ``mode``: "full" (default), or "eager" to run the same loop without graphs (for
    parity checks, or machines without CUDA). ``optimizer`` is checked before capture
    (a host-side step counter would be frozen by the graph) and its gradients are set
    to None right before capture. ``ddp_kwargs`` go to DistributedDataParallel, which
    wraps ``model`` when a process group is initialized.
    """

    def __init__(self, step_fn: Callable[..., Any], model: torch.nn.Module,
                 optimizer: Optional[torch.optim.Optimizer] = None, *, mode: str = "full",
                 warmup_iters: int = 11, capture_error_mode: str = "global", on_failure: str = "fail",
                 compile_model: bool = False, ddp_kwargs: Optional[Dict[str, Any]] = None,
                 device: Optional[torch.device] = None):
        if device is None:
            device = next(model.parameters()).device
        device = torch.device(device)
        world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self.options = GraphOptions(mode=mode, warmup_iters=warmup_iters, capture_error_mode=capture_error_mode,
                                    on_failure=on_failure, compile_model=compile_model
                                    ).resolved(device.type, world_size, torch.cuda.is_available())
        if self.options.mode not in STEP_MODES:
            raise GraphConfigError(f"{{mode}}={self.options.mode.value!r}: GraphedStep runs "
                                   f"{' or '.join(repr(m.value) for m in STEP_MODES)} "
                                   "(partial and compile graph the model, not a step)")
        if optimizer is not None and self.options.mode is GraphMode.full:
            problem = optimizer_capture_problem(optimizer)
            if problem:
                raise GraphConfigError(problem)
            if float_learning_rate(optimizer) and is_main_rank():
                log.warning("the optimizer's lr is a Python float: the graph keeps the value it had at capture. "
                            "To change it while training, pass lr=torch.tensor(lr, device=...) and write it in place")
        self.step_fn, self.optimizer, self.device = step_fn, optimizer, device
        self.executor: Executor = build_executor(self.options, device, ddp_kwargs)
        self.module = model
        self.model = self.executor.wrap_model(model)
        self._static: Optional[Sequence[Any]] = None
        self._inputs: Sequence[Any] = ()
        self._outputs: Any = None

    @property
    def phase(self) -> str:
        """What the next call will be: "warmup", "eager", "capture" or "graph"."""
        return self.executor.phase(StepRole.train)

    @property
    def report(self) -> ExecutionReport:
        """Mode in force, capture seconds, graph pool MiB, the fallback reason if any."""
        return self.executor.report

    def __call__(self, *inputs: Any) -> Any:
        if self._static is None:
            self._static = [_static_like(x, self.device) for x in inputs]
        else:
            _check_same_layout(self._static, inputs)
        self._inputs = inputs
        if self.optimizer is not None and self.phase == "capture":
            self.optimizer.zero_grad(set_to_none=True)  # backward then allocates .grad in the graph's pool
        self.executor.run(StepRole.train, self._stage, self._run)
        return self._outputs

    def _stage(self) -> None:
        for buffer, value in zip(self._static, self._inputs):
            if isinstance(value, torch.Tensor):
                buffer.copy_(value, non_blocking=True)

    def _run(self) -> None:
        self._outputs = self.step_fn(self.model, *self._static)

    def close(self) -> None:
        """Releases the graph and its memory pool: call before the process group is destroyed."""
        self.executor.close()

    def __enter__(self) -> "GraphedStep":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _static_like(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return torch.empty_like(value, device=device)
    return value  # non-tensors are passed as they were at the first call (and captured so)


def _check_same_layout(static: Sequence[Any], inputs: Sequence[Any]) -> None:
    if len(inputs) != len(static):
        raise ValueError(f"GraphedStep was first called with {len(static)} arguments, now with {len(inputs)}")
    for i, (buffer, value) in enumerate(zip(static, inputs)):
        if isinstance(buffer, torch.Tensor):
            if not isinstance(value, torch.Tensor) or value.shape != buffer.shape or value.dtype != buffer.dtype:
                got = f"{tuple(value.shape)} {value.dtype}" if isinstance(value, torch.Tensor) else type(value).__name__
                raise ValueError(f"argument {i} changed from {tuple(buffer.shape)} {buffer.dtype} to {got}: a graph "
                                 "replays fixed shapes; drop or pad the last partial batch")
        elif value != buffer:
            raise ValueError(f"argument {i} changed from {buffer!r} to {value!r}: a graph replays the Python values "
                             "it was captured with; pass values that change as tensors")
