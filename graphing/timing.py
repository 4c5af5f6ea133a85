"""Step timing without host syncs: CUDA events recorded per step, read lazily.

Each ``step(phase)`` records an event (or a host clock on CPU); the interval since the
previous mark is that step's time, filed under the phase of the step that ended.
Events are resolved only in ``collect()``, which the loop calls at its log interval,
where it synchronizes anyway. ``restart()`` after an interruption (evaluation,
logging) keeps that time out of the next step's interval.
"""
from __future__ import annotations

import statistics
import time
from collections import defaultdict
from typing import Dict, List

import torch


class StepTimer:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.durations_ms: Dict[str, List[float]] = defaultdict(list)
        self.sequence_ms: List[float] = []  # every collected step, in order, whatever its phase
        self._pending: list = []
        self._last = None
        self.restart()

    def _marker(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def restart(self) -> None:
        self._last = self._marker()

    def step(self, phase: str) -> None:
        now = self._marker()
        self._pending.append((self._last, now, phase))
        self._last = now

    def collect(self) -> None:
        if not self._pending:
            return
        if self.cuda:
            self._pending[-1][1].synchronize()
        for begin, end, phase in self._pending:
            ms = begin.elapsed_time(end) if self.cuda else (end - begin) * 1e3
            self.durations_ms[phase].append(ms)
            self.sequence_ms.append(ms)
        self._pending.clear()

    def summary(self, phase: str) -> Dict[str, float]:
        """Median, p90 and mean step time of ``phase`` in ms, and the number of steps timed."""
        xs = self.durations_ms.get(phase, [])
        if not xs:
            return {}
        ordered = sorted(xs)
        return {
            "step_ms_median": statistics.median(ordered),
            "step_ms_p90": ordered[min(len(ordered) - 1, int(round(0.9 * (len(ordered) - 1))))],
            "step_ms_mean": sum(ordered) / len(ordered),
            "steps_timed": len(ordered),
        }

