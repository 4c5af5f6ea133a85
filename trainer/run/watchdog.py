"""A step watchdog on every rank: a lost or stuck peer ends the job within a minute instead of hanging it.

torch's process-group timeout covers eager collectives only: ProcessGroupNCCL gives its watchdog no work item for a
collective replayed from a CUDA graph, and a gloo collective waits out the whole timeout (600 s here). So when a peer
stops inside a step (a GPU off the bus, a process the kernel stopped, a deadlock, a frozen node), every other rank
would wait inside the step's collectives for good.

``StallWatchdog`` watches progress from a thread of its own:
- the loop marks each step it launches (``step``): a float store, and on CUDA an event recorded after the step at
  most twice a second (and at least every ``EVENT_EVERY_STEPS`` steps, however far the host runs ahead), which
  the thread queries: the device's progress, not the host's, without a sync;
  evaluation marks its batches the same way (``step(..., what=EVALUATION)``), so a peer lost in an evaluation is
  found as fast as one lost in training;
- longer phases announce themselves with an allowance (``expect``): the first steps of each graph (compile,
  warm-up, capture), an evaluation's first batches, a checkpoint's save;
- no progress within the deadline (``train.stall_timeout_s``, at least 20 median steps; an allowance where one was
  given), and it prints which rank, step and phase waited how long, with every thread's stack, aborts the process
  group where the backend can (NCCL's kernels then stop), and exits with ``EXIT_STALLED``, so that torchrun's
  ``--max-restarts`` or the scheduler's requeue restarts the job from its last checkpoint.
A rank that cannot run this thread (stopped, or stuck in C holding the GIL) is ended by its guard process
(trainer/run/stall_guard.py), which the thread feeds a heartbeat every second.
"""
from __future__ import annotations

import faulthandler
import logging
import os
import statistics
import subprocess
import sys
import threading
import time
from collections import deque
from typing import Deque, Optional

import torch

from graphing.capture import outside_capture
from trainer.run.errors import EXIT_STALLED

log = logging.getLogger(__name__)

STEPS_OF_DEADLINE = 20  # the deadline is at least this many median steps
TICK_S = 1.0  # how often the thread looks (and feeds the guard)
GUARD_FACTOR = 2.0  # the guard's deadline over the watchdog's
TRAINING = "a training step"  # what the watchdog waits on between the phases expect() announces
EVALUATION = "an evaluation"
EVENT_EVERY_S = 0.5  # a CUDA event after a step at most this often by the host's clock: nothing per step worth measuring
# ... and at least every this many steps: a host that runs ahead of the device (steps fed from device memory queue
# with no sync until a metric read) would otherwise leave the device a long run of steps without an event, whose
# time could pass the deadline (at least STEPS_OF_DEADLINE median steps) on a healthy rank
EVENT_EVERY_STEPS = STEPS_OF_DEADLINE // 2


class StallWatchdog:
    """Started by ``start()``, stopped by ``close()`` (also when the run ends by an error: a context manager)."""

    def __init__(self, timeout_s: float, rank: int, device: torch.device, *, guard: bool = True,
                 exit_code: int = EXIT_STALLED):
        self.timeout_s, self.rank, self.device, self.exit_code = float(timeout_s), rank, device, exit_code
        self._last = time.monotonic()  # the last progress seen
        self._deadline = self.timeout_s  # from _last: the timeout, or the current phase's allowance
        self._what = "starting"
        self._step = 0
        self._pending: Deque = deque()  # (step, CUDA event recorded after it, steady)
        self._done_step: Optional[int] = None  # the last step known done, and when: the median step's times
        self._done_at = self._last
        self._last_event_at = 0.0
        self._since_event = 0  # steps (or evaluation batches) launched since the last event
        self._intervals: Deque[float] = deque(maxlen=50)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="stall-watchdog", daemon=True)
        # the guard waits twice as long: the peers of a stopped rank then end first, each saying so with exit 8
        self._guard = _start_guard(rank, GUARD_FACTOR * self.timeout_s) if guard else None

    # ---- the loop's marks (main thread) -------------------------------------------------------------
    def expect(self, what: str, allowance_s: Optional[float] = None, step: Optional[int] = None) -> None:
        """Progress now, and the next may take up to ``allowance_s`` (at least the timeout): ``what`` names it
        (the first steps of a graph, an evaluation, a checkpoint's save)."""
        self._what = what
        if step is not None:
            self._step = step
        self._deadline = max(self.timeout_s, allowance_s or 0.0)
        self._last = time.monotonic()

    @property
    def at_step(self) -> int:
        """The training step the watchdog's messages name: the last one marked or announced."""
        return self._step

    def step(self, step: int, steady: bool, what: str = TRAINING) -> None:
        """Step ``step`` is launched (a CPU's: done); ``steady``: a step like the ones before it (not a warm-up,
        capture or compile), whose time counts toward the median. ``what``: a training step, or an evaluation's
        batch (``EVALUATION``, with the training step it follows; never steady)."""
        now = time.monotonic()
        if self.device.type != "cuda":  # the step ran on this thread: it is done
            self._progress(step, now, steady, what)
            return
        if self._what != what:  # the phase announced by expect() ended on the host now: steps are watched again
            self._what, self._deadline, self._last = what, self.deadline(), now
        self._since_event += 1
        if now - self._last_event_at >= EVENT_EVERY_S or self._since_event >= EVENT_EVERY_STEPS:
            event = torch.cuda.Event()
            event.record()
            self._pending.append((step, event, steady, what))
            self._last_event_at, self._since_event = now, 0

    def _progress(self, step: int, now: float, steady: bool, what: str) -> None:
        """Step ``step`` is done at ``now``: progress; its time per step since the last one done counts when steady."""
        if steady and self._done_step is not None and step > self._done_step:
            self._intervals.append((now - self._done_at) / (step - self._done_step))
        self._done_step, self._done_at, self._step, self._last = step, now, step, now
        self._what, self._deadline = what, self.deadline()

    def deadline(self) -> float:
        """The timeout, or more where the median step is long."""
        if len(self._intervals) < 5:
            return self.timeout_s
        return max(self.timeout_s, STEPS_OF_DEADLINE * statistics.median(self._intervals))

    # ---- the thread --------------------------------------------------------------------------------------
    def start(self) -> "StallWatchdog":
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2 * TICK_S)
        if self._guard is not None:
            try:
                self._guard.stdin.close()  # the guard exits on its pipe's end
            except OSError:
                pass
            self._guard.wait(timeout=5)
            self._guard = None

    def __enter__(self) -> "StallWatchdog":
        return self.start()

    def __exit__(self, *exc) -> bool:
        self.close()
        return False

    def _watch(self) -> None:
        while not self._stop.wait(TICK_S):
            self._feed_guard()
            self._collect()
            waited = time.monotonic() - self._last
            if waited > self._deadline:
                self._stalled(waited)

    def _collect(self) -> None:
        """The steps the device finished since the last look (their events queried: no sync). Not while the loop
        captures a graph: under capture_error_mode="global" the query would break the capture (the capture's phase
        has its allowance; the events are read at the next look)."""
        with outside_capture() as free:
            while free and self._pending and self._pending[0][1].query():
                step, _, steady, what = self._pending.popleft()
                if self._what == what:  # a phase announced since (a save, a first batch) keeps its allowance
                    self._progress(step, time.monotonic(), steady, what)
                else:
                    self._last = time.monotonic()

    def _feed_guard(self) -> None:
        if self._guard is None:
            return
        try:
            os.write(self._guard.stdin.fileno(), b".")
        except OSError:  # the guard is gone: nothing to feed
            self._guard = None

    def _stalled(self, waited: float) -> None:
        message = (f"rank {self.rank}: no progress for {waited:.0f} s in {self._what} at step {self._step} "
                   f"(train.stall_timeout_s={self.timeout_s:g}): a peer rank is lost or stuck; stopping with exit "
                   f"code {self.exit_code} so that the job can restart from its last checkpoint (torchrun "
                   "--max-restarts, or the scheduler's requeue). Where every thread of this rank was:")
        print(message, file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        _abort_process_group()
        from trainer.run.process import tell_torchrun
        from trainer.run.stop import _exit_now

        tell_torchrun(message.rsplit(".", 1)[0])
        _exit_now(self.exit_code)


def _abort_process_group() -> None:
    """Aborts the default process group where the backend can (NCCL: its kernels stop), in a thread with a
    deadline: an abort that hangs must not keep the rank from exiting."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is None:
        return
    done = threading.Thread(target=lambda: _quietly(abort), name="abort-process-group", daemon=True)
    done.start()
    done.join(timeout=10)


def _quietly(fn) -> None:
    try:
        fn()
    except Exception as e:  # gloo cannot abort: the exit below ends its connections
        log.debug("process group abort: %s", e)


def _start_guard(rank: int, timeout_s: float) -> Optional[subprocess.Popen]:
    """The guard process (trainer/run/stall_guard.py) for this rank, fed by the watchdog thread; None where it
    cannot start (the watchdog still covers a lost peer)."""
    try:
        return subprocess.Popen([sys.executable, "-m", "trainer.run.stall_guard", str(os.getpid()), str(rank),
                                 str(timeout_s)], stdin=subprocess.PIPE, cwd=os.path.dirname(os.path.dirname(
                                     os.path.dirname(os.path.abspath(__file__)))))
    except OSError as e:
        log.warning("the stall guard did not start (%s): a stopped rank is not ended by it", e)
        return None
