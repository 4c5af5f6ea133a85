"""``GraphedStep``: graph the training step of your own loop, with no config system.

    model = Net().cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)

    def train_step(model, x, y):               # model: what GraphedStep built (DDP under torchrun)
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        return loss.detach()                   # outputs: device tensors, no .item() here

    step = graphing.GraphedStep(train_step, model, optimizer, capture_error_mode="thread_local")
    for it, (x, y) in enumerate(loader):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(it)            # a float written between calls: carried into the graph
        loss = step(x, y)                      # copies x, y into static buffers, then runs the step
    step.close()                               # before dist.destroy_process_group()

What happens: the first ``warmup_iters`` calls (11, what DDP needs) run eagerly on a side
stream, where DDP was also built; then all ranks meet, each captures its own graph
with ``capture_error_mode``, and they agree on the outcome: every rank replays, or every
rank stops with the reason (``on_failure="fail"``) or goes on eagerly (``"eager"``).

Inputs of another shape (a last partial batch, a few sequence lengths) get a graph of
their own, after ``shape_warmup_iters`` eager calls at that shape, up to ``max_graphs``;
all graphs share one memory pool (graphing/full.py says why that is safe). Under
DDP every rank must bring the same shapes at the same call: when a shape first appears
the ranks check that they agree (one collective then, none per step; set
``check_shapes_every_step=True`` to check every call while debugging a loop).
A failed capture that stops the run is followed by one more eager step with the graph
doctor's checks on, so that the error names the line in your code that broke it.

What your loop does around the step is carried or refused, never silently frozen: the
optimizer is made capturable if it was not (before its first step), the lr you write or a
torch scheduler steps between calls is copied into the graph (graphing/hyperparams.py; Adam's
betas too, where its step reads them as tensors), an lr changed inside the step function (a
scheduler stepped there, or a value assigned) is refused at the first call, naming the line
(found by one more eager call of the step, traced), a change to another hyperparameter
after capture raises, and a model you wrapped in DDP yourself is re-wrapped with the same
settings on the capture stream (graphing/ddp.py).
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Dict, Optional, Sequence

import torch
import torch.distributed as dist

from graphing.ddp import forward_through, merge_ddp_kwargs, release_reducer, unwrap_ddp
from graphing.deprecation import warn_renamed_once
from graphing.executor import ExecutionReport, Executor, StepRole, is_main_rank
from graphing.factory import build_executor
from graphing.hyperparams import CarriedHyperparameters
from graphing.optimizers import closure_problem, make_graph_safe
from graphing.options import STEP_MODES, GraphConfigError, GraphMode, GraphOptions, literal

log = logging.getLogger(__name__)


class GraphedStep:
    """Runs ``step_fn(model, *inputs)`` eagerly for warm-up, then as one CUDA graph per rank.

    ``step_fn`` must be graph-safe: no host syncs (``.item()``, ``.cpu()``,
    ``print(tensor)``, a tensor in an ``if``). Each call copies its tensor arguments into
    static device buffers made for their shapes and dtypes (one set, and one graph, per
    distinct set of shapes) and returns what ``step_fn`` returned: in graph phase the
    same tensors every time that shape replays, overwritten by its next call, so clone
    what you keep. Arguments that are not tensors are captured as values and must not change.

    ``mode``: "full" (default), or "eager" to run the same loop without graphs (for
    parity checks, or machines without CUDA). ``optimizer`` (full mode): made graph-safe
    before the first call where it can be (``capturable=True``; ``fused=True`` for SGD),
    refused with the fix where it cannot; each group's lr is carried into the graph (write
    floats between calls as usual); its gradients are set to None right before capture.
    ``model``: a module, or one you wrapped in DDP yourself; under a process group it is
    wrapped in DistributedDataParallel with ``ddp_kwargs`` (and a DDP model's own settings).
    ``self.model`` is what ``step_fn`` receives.
    """

    def __init__(self, step_fn: Callable[..., Any], model: torch.nn.Module,
                 optimizer: Optional[torch.optim.Optimizer] = None, *, mode: str = "full",
                 warmup_iters: int = 11, capture_error_mode: str = "global", on_failure: str = "fail",
                 compile_model: bool = False, ddp_kwargs: Optional[Dict[str, Any]] = None,
                 device: Optional[torch.device] = None, max_graphs: int = 8, shape_warmup_iters: int = 1,
                 check_shapes_every_step: bool = False):
        if device is None:
            device = next(model.parameters()).device
        device = torch.device(device)
        world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self.options = GraphOptions(mode=mode, warmup_iters=warmup_iters, capture_error_mode=capture_error_mode,
                                    on_failure=on_failure, compile_model=compile_model, max_graphs=max_graphs,
                                    shape_warmup_iters=shape_warmup_iters).resolved(device.type, world_size, torch.cuda.is_available())
        if self.options.mode not in STEP_MODES:
            raise GraphConfigError(f"{{mode}}={self.options.mode.value!r}: GraphedStep runs "
                                   f"{' or '.join(repr(m.value) for m in STEP_MODES)} "
                                   "(partial and compile graph the model, not a step)")
        if optimizer is not None:
            problem = closure_problem(optimizer)
            if problem:
                raise GraphConfigError(literal(problem))
        self.made_safe: list = []  # what was changed on the optimizer for the graph
        self.hyperparams: Optional[CarriedHyperparameters] = None
        if optimizer is not None and self.options.mode is GraphMode.full:
            self.made_safe = make_graph_safe(optimizer)
            self.hyperparams = CarriedHyperparameters(optimizer, device)
            if self.made_safe and is_main_rank():
                log.info("GraphedStep made the optimizer graph-safe: %s", "; ".join(self.made_safe))
        module, taken, comm_hooks = unwrap_ddp(model)
        self.step_fn, self.optimizer, self.device = step_fn, optimizer, device
        self.executor: Executor = build_executor(self.options, device, merge_ddp_kwargs(taken, ddp_kwargs))
        self.module = module
        if module is not model:
            release_reducer(model)  # before the new DDP takes the gradient accumulators (graphing/ddp.py)
        self.model = self.executor.wrap_model(module)
        for hook, state in comm_hooks:
            self.model.register_comm_hook(state, hook)
        if module is not model:
            forward_through(model, self.model)
        self.check_shapes_every_step = check_shapes_every_step
        self._slots: Dict[str, _Slot] = {}  # per input shapes: static buffers and the outputs of its graph
        self._slot: Optional[_Slot] = None  # the current call's
        self._inputs: Sequence[Any] = ()

    @property
    def phase(self) -> str:
        """What the next call with the last call's shapes will be: "warmup", "eager", "capture" or "graph"."""
        return self.executor.phase(StepRole.train, self._slot.shape if self._slot else None)

    @property
    def report(self) -> ExecutionReport:
        """Mode in force, capture seconds, graph pool MiB, the fallback reason if any."""
        return self.executor.report

    @property
    def info(self) -> Dict[str, Any]:
        """Deprecated since graphing 0.2: use ``report`` (an ``ExecutionReport``). The dict ``info``
        returned before: mode, capture_error_mode, compile_model (full mode), ``train_capture_s``,
        ``graph_pool_mib`` and ``fallback`` where they exist."""
        warn_renamed_once("GraphedStep.info", "GraphedStep.report (an ExecutionReport)")
        report = self.report
        info: Dict[str, Any] = {"mode": report.mode, "capture_error_mode": report.capture_error_mode}
        if self.options.mode is GraphMode.full:
            info["compile_model"] = self.options.compile_model
        info.update({f"{role.value}_capture_s": seconds for role, seconds in report.capture_s.items()})
        if report.graph_pool_mib is not None:
            info["graph_pool_mib"] = report.graph_pool_mib
        if report.fallback:
            info["fallback"] = report.fallback
        return info

    def __call__(self, *inputs: Any) -> Any:
        shape = shapes_of(inputs)
        slot = self._slots.get(shape)
        if slot is None:
            if self._slots:
                _check_same_layout(next(iter(self._slots.values())).static, inputs)
            self._agree_on(shape, "a new input shape first appeared")
            slot = self._slots[shape] = _Slot(shape, [_static_like(x, self.device) for x in inputs])
        else:
            _check_same_layout(slot.static, inputs)
            if self.check_shapes_every_step:
                self._agree_on(shape, "check_shapes_every_step=True")
        self._slot, self._inputs = slot, inputs
        if self.optimizer is not None and self.phase == "capture":
            self.optimizer.zero_grad(set_to_none=True)  # backward then allocates .grad in the graph's pool
        hyperparams = self.hyperparams
        try:
            self.executor.run(StepRole.train, self._stage, self._run, shape)
        except BaseException:
            if hyperparams is not None:
                hyperparams.restore()
            raise
        if hyperparams is not None:
            change = hyperparams.after_call()
            if change:
                raise hyperparams.refusal(getattr(self.step_fn, "__qualname__", "the step function"), change,
                                          hyperparams.line_of_change(self._run))
            if self.report.graphs:
                hyperparams.freeze_the_rest()
        return slot.outputs

    def _agree_on(self, shape: str, why: str) -> None:
        """Every rank brings ``shape`` to this call, or every rank raises, naming each rank's shapes."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return
        shapes: list = [None] * dist.get_world_size()
        dist.all_gather_object(shapes, shape)
        if len(set(shapes)) > 1:
            ranks = "; ".join(f"rank {r}: {s}" for r, s in enumerate(shapes))
            raise ValueError(f"the ranks called GraphedStep with different input shapes ({ranks}), checked because "
                             f"{why}: under DDP every rank must bring the same shapes at the same call (each "
                             "shape's graph holds its own all-reduce); pad or bucket the batches alike on every rank")

    def _stage(self) -> None:
        if self.hyperparams is not None:
            self.hyperparams.before_call()  # the lr the loop wrote, into the tensor the step reads
        for buffer, value in zip(self._slot.static, self._inputs):
            if isinstance(value, torch.Tensor):
                buffer.copy_(value, non_blocking=True)

    def _run(self) -> None:
        # Each graph's outputs stay referenced by its slot for the graph's life: no later
        # capture in the shared pool is given their memory (graphing/full.py).
        self._slot.outputs = self.step_fn(self.model, *self._slot.static)

    def close(self) -> None:
        """Releases the graph and its memory pool: call before the process group is destroyed."""
        self.executor.close()

    def __enter__(self) -> "GraphedStep":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Slot:
    """What one set of input shapes has: its name, static input buffers, its graph's outputs."""

    def __init__(self, shape: str, static: Sequence[Any]):
        self.shape, self.static, self.outputs = shape, static, None


def shapes_of(inputs: Sequence[Any]) -> str:
    """The tensor arguments' shapes and dtypes as one name, e.g. "64x784:float32,64:int64"
    (a graph's name in reports; non-tensors are marked "-")."""
    def one(x):
        if not isinstance(x, torch.Tensor):
            return "-"
        return "x".join(map(str, x.shape)) + ":" + str(x.dtype).replace("torch.", "")
    return ",".join(one(x) for x in inputs)


def _static_like(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return torch.empty_like(value, device=device)
    return value  # non-tensors are passed as they were at the first call (and captured so)


def _check_same_layout(static: Sequence[Any], inputs: Sequence[Any]) -> None:
    if len(inputs) != len(static):
        raise ValueError(f"GraphedStep was first called with {len(static)} arguments, now with {len(inputs)}")
    for i, (buffer, value) in enumerate(zip(static, inputs)):
        if isinstance(buffer, torch.Tensor):
            if not isinstance(value, torch.Tensor):
                raise ValueError(f"argument {i} was a tensor at the first call and is a {type(value).__name__} now: "
                                 "pass a tensor at every call")
        elif value != buffer:
            raise ValueError(f"argument {i} changed from {buffer!r} to {value!r}: a graph replays the Python values "
                             "it was captured with; pass values that change as tensors")
