"""The eager executor, and the interface every mode implements.

An executor decides how one step runs. The caller hands it two callables per role
("train" or "eval"): ``stage``, host work that fills the step's static inputs, and
``fn``, the device work of the step itself. ``run(role, stage, fn)`` executes one step;
``phase(role)`` names what the next step will be (warmup, eager, capture, graph) so
that timings are filed honestly. Everything that differs between modes lives in the
executors; their caller never asks which mode it has.
"""
from __future__ import annotations

import contextlib
import logging
from collections import Counter
from typing import Any, Callable, Dict, Optional, Tuple

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from graphing.capture import CaptureError
from graphing.options import GraphOptions

log = logging.getLogger(__name__)

SampleInputs = Callable[[], Tuple[torch.Tensor, ...]]


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def is_main_rank() -> bool:
    return not distributed() or dist.get_rank() == 0


class Executor:
    """Plain eager execution (under DDP when a process group is up)."""

    captures_optimizer = False  # whether optimizer.step() runs inside a captured graph

    def __init__(self, options: GraphOptions, device: torch.device, ddp_kwargs: Optional[Dict[str, Any]] = None):
        self.options, self.device = options, torch.device(device)
        self.ddp_kwargs = dict(ddp_kwargs or {})
        self.warmup_iters = options.warmup_iters
        self.calls: Counter = Counter()
        # What ran, for results and logs; capture_error_mode is the one in force (None: no capture of ours).
        self.info: Dict[str, object] = {"mode": options.mode, "capture_error_mode": None}
        self.eval_model: Optional[torch.nn.Module] = None
        self.closed = False

    def wrap_model(self, model: torch.nn.Module, sample_inputs: Optional[SampleInputs] = None,
                   autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
                   ) -> torch.nn.Module:
        """The module the training step calls (DDP-wrapped when a process group is up).

        ``sample_inputs`` returns one model input (only modes that trace the model ahead
        of time call it); ``autocast`` is the precision context the step runs under.
        """
        self.eval_model = model
        return self._ddp(model)

    def wrap_output_fn(self, fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        """A function the training step applies to the model's output (its loss, its metrics): as given, here."""
        return fn

    def _ddp(self, model: torch.nn.Module) -> torch.nn.Module:
        if not distributed():
            return model
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        return DDP(model, device_ids=device_ids, **self.ddp_kwargs)

    def phase(self, role: str) -> str:
        return "warmup" if self.calls[role] < self.warmup_iters else "eager"

    def run(self, role: str, stage: Callable[[], None], fn: Callable[[], None]) -> None:
        self._check_open()
        self.calls[role] += 1
        stage()
        fn()

    def _agree_on_capture(self, failure: Optional[str]) -> bool:
        """True when every rank captured. Otherwise every rank stops with the reason
        (``on_failure=fail``: CaptureError) or records the fallback and goes on eagerly (False)."""
        if self._all_agree(failure is None):
            return True
        message = failure or "CUDA graph capture failed on another rank; that rank's log says why."
        if self.options.on_failure == "fail":
            raise CaptureError(message)
        self.info["fallback"] = message
        self.info["mode"] = "eager (fallback)"
        report = log.warning if is_main_rank() else log.info  # the same on every rank: say it once
        report("%s\n%son_failure=eager: every rank continues eagerly.", message, self.options.setting_prefix)
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
