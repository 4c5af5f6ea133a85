"""The eager executor, and the interface every mode implements.

An executor decides how one step runs. The caller hands it two callables per
``StepRole`` (train or eval): ``stage``, host work that fills the step's static inputs,
and ``fn``, the device work of the step itself. ``run(role, stage, fn, shape)`` executes
one step; ``shape`` (any hashable whose ``str`` names it; None: the one shape) says which
input shapes the step has, and each shape gets its own graph. ``phase(role, shape)``
names what the next step will be (warmup, eager, capture, graph) so that timings are
filed honestly; ``report`` says what ran (``ExecutionReport``).
How a step runs in each mode lives in the executors. Their caller asks only what it builds
around them: whether the optimizer's step is captured (``captures_optimizer``), and, from the
options, whether steps are graphed (each new shape a graph) and the model compiled.
"""
from __future__ import annotations

import contextlib
import logging
from collections import Counter
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, Dict, Hashable, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from graphing.capture import CaptureError
from graphing.deprecation import warn_renamed_once
from graphing.options import GraphOptions, literal, own_name
from graphing.sharded import is_sharded

log = logging.getLogger(__name__)

SampleInputs = Callable[[], Tuple[torch.Tensor, ...]]
Shape = Optional[Hashable]  # a step's input shapes, as its caller names them (None: the step has one)
CommHook = Callable[[Any, "dist.GradBucket"], torch.futures.Future]  # DDP's: reduces one bucket of gradients


class StepRole(Enum):
    """Which step a call runs; each role gets its own graph (eval's forward-only one shares
    the train graph's memory pool)."""
    train = "train"
    eval = "eval"


@dataclass
class GraphRecord:
    """One captured graph: its role, the input shape it replays, how long its capture took
    and the shared memory pool's size once it was captured."""
    role: StepRole
    shape: str
    capture_s: float
    pool_mib: float


@dataclass
class ExecutionReport:
    """What an executor ran: filled in as it goes, read for results and logs.

    ``mode``: the mode in force ("eager (fallback)" after a failed capture);
    ``capture_error_mode``: the one a capture of ours used (None: no capture of ours,
    "inductor": torch.compile's own graphs); ``capture_s``: seconds each role's capture took;
    ``graph_pool_mib``: the graphs' memory pool; ``fallback``: why capture was given up.
    Whether the model is compiled is the executor's ``options.compile_model`` (``GraphOptions``).
    """
    mode: str
    capture_error_mode: Optional[str] = None
    capture_s: Dict[StepRole, float] = field(default_factory=dict)
    graph_pool_mib: Optional[float] = None
    graphs: List[GraphRecord] = field(default_factory=list)
    eager_shapes: List[str] = field(default_factory=list)
    fallback: Optional[str] = None
    _compile_model: bool = field(default=False, init=False, repr=False, compare=False)  # for the alias only

    @property
    def compile_model(self) -> bool:
        """Deprecated (CHANGELOG.md): read ``options.compile_model`` of the executor (or of the
        ``GraphedStep``), the setting itself; this copy of it was written by full mode only."""
        warn_renamed_once("ExecutionReport.compile_model", "the executor's options.compile_model (GraphOptions)")
        return self._compile_model

    def as_results(self) -> Dict[str, Any]:
        """The graph numbers of a run's results: ``train_capture_s``, ``graph_pool_mib``, and
        per graph ``<role>@<shape>/capture_s`` and ``.../pool_mib`` (the pool once it was captured)."""
        out: Dict[str, Any] = {f"{role.value}_capture_s": s for role, s in self.capture_s.items()}
        if self.graph_pool_mib is not None:
            out["graph_pool_mib"] = self.graph_pool_mib
        if self.graphs:
            out["graphs"] = len(self.graphs)
        for g in self.graphs:
            out[f"{g.role.value}@{g.shape}/capture_s"] = g.capture_s
            out[f"{g.role.value}@{g.shape}/pool_mib"] = g.pool_mib
        if self.eager_shapes:
            out["eager_shapes"] = list(self.eager_shapes)
        if self.fallback is not None:
            out["fallback"] = self.fallback
        return out


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def is_main_rank() -> bool:
    return not distributed() or dist.get_rank() == 0


def log_fallback(failure: CaptureError, name: Callable[[str], str] = own_name) -> None:
    """Says once that a capture was given up under ``on_failure=eager``, each setting named by ``name``."""
    say = log.warning if is_main_rank() else log.info  # the same on every rank
    say("%s\n%s=eager: every rank continues eagerly.", failure.render(name), name("on_failure"))


class Executor:
    """Plain eager execution (under DDP when a process group is up).

    ``on_fallback`` is told when a failed capture is given up for eager execution
    (``on_failure="eager"``); a caller with its own names for the settings words it.
    ``comm_hook`` (``(state, bucket) -> Future``, as ``DDP.register_comm_hook`` takes it) is
    registered on the DDP this executor builds, with DDP's process group as its state (None:
    the default group), which is what torch's ``ddp_comm_hooks.default_hooks`` expect.
    """

    captures_optimizer = False  # whether optimizer.step() runs inside a captured graph

    def __init__(self, options: GraphOptions, device: torch.device, ddp_kwargs: Optional[Dict[str, Any]] = None,
                 on_fallback: Callable[[CaptureError], None] = log_fallback, comm_hook: Optional[CommHook] = None):
        self.options, self.device = options, torch.device(device)
        self.ddp_kwargs = dict(ddp_kwargs or {})
        self.comm_hook = comm_hook
        self.on_fallback = on_fallback
        self.warmup_iters = options.warmup_iters
        self.calls: Counter = Counter()
        self.report = ExecutionReport(mode=options.mode.value)
        self.eval_model: Optional[torch.nn.Module] = None
        self.closed = False

    def wrap_model(self, model: torch.nn.Module, sample_inputs: Optional[SampleInputs] = None,
                   autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
                   ) -> torch.nn.Module:
        """The module the training step calls (DDP-wrapped when a process group is up).

        ``sample_inputs`` returns the tensors the step passes the model, positionally, for one
        batch (only modes that trace the model ahead of time call it); ``autocast`` is the
        precision context the step runs under.
        """
        self.eval_model = model
        return self._ddp(model)

    def wrap_output_fn(self, fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        """A function the training step applies to the model's output (its loss, its metrics): as given, here."""
        return fn

    def _ddp(self, model: torch.nn.Module) -> torch.nn.Module:
        if not distributed() or is_sharded(model):  # FSDP2 communicates itself: no DDP around it
            return model
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        ddp = DDP(model, **{"device_ids": device_ids, **self.ddp_kwargs})  # a re-wrapped DDP brings its own
        if self.comm_hook is not None:  # before the first backward: DDP takes hooks only then
            ddp.register_comm_hook(self.ddp_kwargs.get("process_group"), self.comm_hook)
        return ddp

    def phase(self, role: StepRole, shape: Shape = None) -> str:
        return "warmup" if self.calls[role] < self.warmup_iters else "eager"

    def run(self, role: StepRole, stage: Callable[[], None], fn: Callable[[], None], shape: Shape = None) -> None:
        self._check_open()
        self.calls[role] += 1
        stage()
        fn()

    def _agree_on_capture(self, failure: Optional[str],
                          find_the_line: Optional[Callable[[], List[str]]] = None) -> bool:
        """True when every rank captured. Otherwise every rank stops with the reason
        (``on_failure=fail``: CaptureError) or records the fallback and goes on eagerly (False).
        ``failure``: this rank's ``CaptureError`` template, or None. ``find_the_line`` (a
        collective, called on every rank only when the run stops): the doctor's findings."""
        if self._all_agree(failure is None):
            return True
        failure = failure or "CUDA graph capture failed on another rank; that rank's log says why."
        if self.options.on_failure == "fail":
            if find_the_line is not None:
                found = find_the_line()
                failure += literal("\n  found by the graph doctor over one more eager step:" + "".join(
                    f"\n    {line}" for line in found) if found else
                    "\n  the graph doctor's checks over one more eager step named no line of the step")
            raise CaptureError(failure)
        error = CaptureError(failure + "\n  to find the line that breaks the capture, run the graph doctor over "
                                       "this step ({doctor})")
        self.report.fallback = str(error)
        self.report.mode = "eager (fallback)"
        self.on_fallback(error)
        return False

    def _all_agree(self, flag: bool) -> bool:
        """True on every rank iff ``flag`` is true on every rank."""
        if not distributed():
            return flag
        votes = torch.tensor([0 if flag else 1], device=self.device)
        dist.all_reduce(votes)
        return int(votes.item()) == 0

    def _check_open(self) -> None:
        if self.closed:  # a step after close() would capture again, perhaps after the process group went
            raise RuntimeError("this executor was closed (its graphs released): build a new one to run more steps")

    def close(self) -> None:
        """Releases graphs and their memory; call before the process group is destroyed."""
        self.closed = True
