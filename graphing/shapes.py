"""Which graph a step's input shape gets, and when: the bookkeeping of ``graph.mode=full``
over several shapes, free of CUDA so that it can be tested anywhere.

Per step role (train, eval) each shape the caller names gets a graph of its own, in the
order the shapes appear, up to ``max_graphs``. A train shape is captured once the step
as a whole has had its ``warmup_iters`` (+ ``eager_steps_before_capture``) eager calls,
whatever their shapes (what DDP needs, once), and the shape itself ``shape_warmup_iters``
(cuBLAS, cuDNN and torch.compile choose kernels per shape); an eval shape after one call.
A shape beyond the bound is refused (``on_failure="fail"``) or runs eagerly for good.

DDP samples its runtime stats, with host syncs, in its first 10 forwards and then at
every 100th (``DDP_STATS_EVERY``); its counter moves only when the DDP module's forward
runs from Python (an eager call or a capture, never a replay). A capture that would fall
on such a forward waits one eager call, so no capture ever holds those syncs, however
many shapes come and whenever they come.
"""
from __future__ import annotations

import logging
from collections import Counter
from typing import Dict, List, Set, Tuple

from graphing.executor import Shape, StepRole, is_main_rank
from graphing.options import DDP_STATS_EVERY, GraphConfigError, GraphOptions

log = logging.getLogger(__name__)


class ShapeBook:
    def __init__(self, options: GraphOptions, ddp: bool):
        self.options, self.ddp = options, ddp
        self.known: Dict[StepRole, List[Shape]] = {role: [] for role in StepRole}  # in order of appearance
        self.calls: Counter = Counter()  # eager calls per (role, shape)
        self.role_calls: Counter = Counter()  # eager calls per role
        self.eager_only: Set[Tuple[StepRole, Shape]] = set()  # beyond max_graphs, under on_failure=eager
        self.ddp_forwards = 0  # the DDP module's forwards from Python: eager train calls and captures

    def warmed_up(self, role: StepRole, shape: Shape) -> bool:
        """Whether ``shape``'s next call may be its capture (the DDP stats aside)."""
        if role is StepRole.eval:
            return self.calls[role, shape] >= 1  # one pass settles cuDNN/compile for the shape
        step_warm = self.role_calls[role] >= self.options.warmup_iters + self.options.eager_steps_before_capture
        return step_warm and self.calls[role, shape] >= self.options.shape_warmup_iters

    def phase(self, role: StepRole, shape: Shape) -> str:
        """What an uncaptured ``shape``'s next call is: warmup, eager or capture."""
        beyond = shape not in self.known[role] and len(self.known[role]) >= self.options.max_graphs
        if beyond or (role, shape) in self.eager_only:
            return "eager"
        if self.warmed_up(role, shape):
            return "capture"
        return "warmup" if self.role_calls[role] < self.options.warmup_iters else "eager"

    def meet(self, role: StepRole, shape: Shape) -> bool:
        """Registers a call at ``shape``: a new shape takes a graph's place, or beyond ``max_graphs``
        is refused (GraphConfigError) or marked to run eagerly (then True, once)."""
        known = self.known[role]
        if shape in known or (role, shape) in self.eager_only:
            return False
        if len(known) < self.options.max_graphs:
            known.append(shape)
            return False
        names = ", ".join(str(s) for s in known)
        if self.options.on_failure == "fail":
            raise GraphConfigError(
                f"the {role.value} step met a {len(known) + 1}th input shape ({shape}) but {{max_graphs}}="
                f"{self.options.max_graphs} bounds its graphs, one per shape (captured or warming up: {names}): "
                "raise {max_graphs}, bring the inputs to fewer shapes (pad them to a few buckets), or set "
                "{on_failure}=eager to run shapes beyond the bound eagerly")
        self.eager_only.add((role, shape))
        (log.warning if is_main_rank() else log.info)(
            "the %s step met input shape %s beyond max_graphs=%d (graphed: %s): it runs eagerly",
            role.value, shape, self.options.max_graphs, names)
        return True

    def capture_now(self, role: StepRole, shape: Shape) -> bool:
        """Whether this call at ``shape`` (registered by ``meet``) is its capture; counts the call."""
        due = (role, shape) not in self.eager_only and self.warmed_up(role, shape) and not self.ddp_samples_next(role)
        if not due:
            self.calls[role, shape] += 1
            self.role_calls[role] += 1
        if role is StepRole.train:
            self.ddp_forwards += 1
        return due

    def ddp_samples_next(self, role: StepRole) -> bool:
        """Whether DDP's next forward, or the one after, samples its runtime stats (host syncs).
        Assumes one synchronizing forward per step call (micro-batches under no_sync run none)."""
        return role is StepRole.train and self.ddp and self.ddp_forwards % DDP_STATS_EVERY in (0, DDP_STATS_EVERY - 1)

    def failed_capture(self, role: StepRole) -> None:
        """A capture was given up and the step runs eagerly instead: one more forward."""
        if role is StepRole.train:
            self.ddp_forwards += 1
