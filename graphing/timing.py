"""Step timing without host syncs: CUDA events recorded per step, read lazily, kept bounded.

Each ``step(phase)`` records an event (or a host clock on CPU); the interval since the
previous mark is that step's time, filed under the phase of the step that ended.
Events are resolved only in ``collect()``, which the loop calls at its log interval,
where it synchronizes anyway. ``restart()`` after an interruption (evaluation,
logging) keeps that time out of the next step's interval.

Memory stays bounded however long the run: each phase keeps its first
``StepTimes.EXACT_LIMIT`` times exactly, then folds them into a histogram of
logarithmic buckets 1% wide, whose quantiles are within 0.5% of the exact ones (the
mean, count, min and max stay exact).
"""
from __future__ import annotations

import math
import statistics
import time
from collections import Counter
from typing import Dict, List, Optional, Tuple

import torch


class StepTimes:
    """The step times of one phase: exact up to ``EXACT_LIMIT`` samples, a 1% histogram beyond."""

    EXACT_LIMIT = 10_000
    _LOG_WIDTH = math.log(1.01)  # bucket i holds [1.01**i, 1.01**(i+1)) ms

    def __init__(self):
        self.count, self.total_ms = 0, 0.0
        self.min_ms, self.max_ms = math.inf, -math.inf
        self._exact: Optional[List[float]] = []
        self._buckets: Counter = Counter()

    def add(self, ms: float) -> None:
        self.count += 1
        self.total_ms += ms
        self.min_ms, self.max_ms = min(self.min_ms, ms), max(self.max_ms, ms)
        if self._exact is None:
            self._buckets[self._bucket(ms)] += 1
            return
        self._exact.append(ms)
        if len(self._exact) > self.EXACT_LIMIT:
            for x in self._exact:
                self._buckets[self._bucket(x)] += 1
            self._exact = None

    @property
    def stored(self) -> int:
        """How many numbers this phase keeps in memory (bounded, however many steps were added)."""
        return len(self._exact) if self._exact is not None else len(self._buckets)

    def _bucket(self, ms: float) -> int:
        return math.floor(math.log(max(ms, 1e-6)) / self._LOG_WIDTH)

    def quantile(self, q: float) -> float:
        """The ``q`` quantile (nearest rank; the median averages the middle pair while exact)."""
        if self._exact is not None:
            ordered = sorted(self._exact)
            if q == 0.5:
                return statistics.median(ordered)
            return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]
        rank = min(self.count - 1, int(round(q * (self.count - 1))))
        seen = 0
        for bucket in sorted(self._buckets):
            seen += self._buckets[bucket]
            if seen > rank:  # the bucket's geometric middle, kept within what was seen
                middle = math.exp((bucket + 0.5) * self._LOG_WIDTH)
                return min(max(middle, self.min_ms), self.max_ms)
        return self.max_ms

    def summary(self) -> Dict[str, float]:
        """Median, p90 and mean step time in ms, and the number of steps timed."""
        return {"step_ms_median": self.quantile(0.5), "step_ms_p90": self.quantile(0.9),
                "step_ms_mean": self.total_ms / self.count, "steps_timed": self.count}


class StepTimer:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.phases: Dict[str, StepTimes] = {}
        self._window: Tuple[int, float] = (0, 0.0)  # steps and ms collected since take_window()
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
        steps, total = self._window
        for begin, end, phase in self._pending:
            ms = begin.elapsed_time(end) if self.cuda else (end - begin) * 1e3
            self.phases.setdefault(phase, StepTimes()).add(ms)
            steps, total = steps + 1, total + ms
        self._window = (steps, total)
        self._pending.clear()

    def take_window(self) -> Tuple[int, float]:
        """(steps, total ms) collected since the last call, whatever their phase."""
        window, self._window = self._window, (0, 0.0)
        return window

    def count(self, phase: str) -> int:
        """Steps of ``phase`` collected so far."""
        times = self.phases.get(phase)
        return times.count if times else 0

    def summary(self, phase: str) -> Dict[str, float]:
        """Median, p90 and mean step time of ``phase`` in ms, and the number of steps timed."""
        times = self.phases.get(phase)
        return times.summary() if times else {}
