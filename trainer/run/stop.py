"""Stopping on a signal without losing work and without waiting on a peer that may be gone.

- SIGINT (Ctrl-C; torchrun forwards it to every rank): every rank exits at once with 130,
  skipping the orderly teardown; rank 0 says so in one line (every rank got the same signal). A rank that waited for its peers in a
  barrier or a collective could wait forever if one of them is already gone.
- SIGTERM (SLURM preemption, ``scancel``, Kubernetes): the ranks agree to stop at the same
  step (``StopAgreement``), write a checkpoint and exit with 143; the same command
  resumes. A rank that cannot get there within ``TERM_GRACE_S`` exits hard, well inside
  the 30 s that torchrun and SLURM give before SIGKILL. A second signal stops at once.
  Both need the GIL; a rank stuck in a C call that holds it (seen once in a gloo rank's
  teardown after SIGTERM, under load) gets neither, so faulthandler's watchdog, a thread of
  C that needs no GIL, prints where every thread is and exits with 1 after ``BACKSTOP_S`` more.

Both signals are blocked in every thread but one, which takes them with ``sigwait``: a
Python signal handler runs only when the main thread returns to the interpreter, which
it does not while it waits inside a collective or a CUDA synchronization.
``install()`` must run before any other thread starts (train.py calls it first thing),
since threads inherit the signal mask of the thread that starts them.
"""
from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
import time

from trainer.run.errors import EXIT_INTERRUPTED, EXIT_PREEMPTED

TERM_GRACE_S = 15.0  # SIGTERM to exit at the latest; torchrun and SLURM send SIGKILL after 30 s
BACKSTOP_S = 5.0  # then, without the GIL: the stacks printed and exit 1, still before SIGKILL

_stop_requested = threading.Event()
_unfinished: set = set()  # temp files being written (checkpoints, results): removed before a hard exit


class writing:
    """``with writing(temp_path):`` while a temp file is written: a hard exit (Ctrl-C, a second signal, the
    grace deadline) removes it rather than leaving half a file behind. A SIGKILL cannot; the next
    checkpoint's retention removes what it left (trainer/checkpoint/retention.py)."""

    def __init__(self, path):
        self.path = str(path)

    def __enter__(self):
        _unfinished.add(self.path)
        return self

    def __exit__(self, *exc):
        _unfinished.discard(self.path)
        return False


def _exit_now(code: int) -> None:
    for path in list(_unfinished):
        try:
            os.unlink(path)
        except OSError:
            pass
    os._exit(code)


def install() -> bool:
    """Takes SIGINT and SIGTERM in a thread of their own; False where the platform cannot."""
    if not hasattr(signal, "pthread_sigmask") or threading.current_thread() is not threading.main_thread():
        return False
    signals = {signal.SIGINT, signal.SIGTERM}
    signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    threading.Thread(target=_take_signals, args=(signals,), name="stop-signals", daemon=True).start()
    return True


def stop_requested() -> bool:
    """True once this process got SIGTERM: the training loop stops at the next agreed step."""
    return _stop_requested.is_set()


def _say(line: str, every_rank: bool = True) -> None:
    if not every_rank and os.environ.get("RANK", "0") != "0":
        return
    try:
        sys.stderr.write(f"[rank {os.environ.get('RANK', '0')}] {line}\n")
        sys.stderr.flush()
    except Exception:  # a closed stderr must not keep the process alive
        pass


def _take_signals(signals) -> None:
    while True:
        sig = signal.sigwait(signals)
        if sig == signal.SIGINT or _stop_requested.is_set():
            name = "interrupted (SIGINT)" if sig == signal.SIGINT else "second SIGTERM"
            _say(f"{name}: stopping now, without writing a checkpoint", every_rank=False)  # all got it
            _exit_now(EXIT_INTERRUPTED if sig == signal.SIGINT else EXIT_PREEMPTED)
        _stop_requested.set()  # said once the ranks have stopped (trainer/run/errors.py Preempted)
        threading.Thread(target=_exit_after_grace, name="stop-deadline", daemon=True).start()
        try:
            faulthandler.dump_traceback_later(TERM_GRACE_S + BACKSTOP_S, exit=True)
        except (ValueError, RuntimeError, OSError):  # no usable stderr: the deadline above is all there is
            pass


def _exit_after_grace() -> None:
    time.sleep(TERM_GRACE_S)
    _say(f"SIGTERM: not stopped after {TERM_GRACE_S:.0f} s; exiting without a new checkpoint; where each "
         "thread was:")
    try:
        faulthandler.dump_traceback(all_threads=True)
    except (ValueError, RuntimeError, OSError):
        pass
    _exit_now(EXIT_PREEMPTED)


class StopAgreement:
    """When the ranks ask each other whether any of them was told to stop.

    One all-reduce of two numbers at steps spaced about ``interval_s`` of training apart
    (never every step): any rank's request, and rank 0's choice of the next check step,
    measured from its own step rate so that the spacing is in seconds, not steps. Every
    rank therefore checks at the same steps and stops at the same one. One process needs
    no agreement and checks its own flag every step, for free.

    A spacing measured over steps alone does not foresee what runs between them (an
    evaluation, a checkpoint): after each, ``soon`` makes the next step a check, so that a
    run of short epochs with long evaluations still stops well inside ``TERM_GRACE_S``.
    """

    def __init__(self, rt, interval_s: float = 2.0):
        self.rt, self.interval_s = rt, interval_s
        self.next_check = 0
        self._since = (0, time.perf_counter())

    def start(self, step: int) -> None:
        self.next_check = step + 1
        self._since = (step, time.perf_counter())

    def soon(self, step: int) -> None:
        """After work that is not a step (every rank does it at the same step): the next step checks."""
        self.next_check = min(self.next_check, step + 1)

    def should_stop(self, step: int) -> bool:
        if not self.rt.distributed:
            return stop_requested()
        if step < self.next_check:
            return False
        import torch
        import torch.distributed as dist

        last_step, last_time = self._since
        now = time.perf_counter()
        rate = (step - last_step) / max(now - last_time, 1e-6)  # steps per second on this rank
        every = max(1, int(rate * self.interval_s)) if self.rt.is_main else 0
        votes = torch.tensor([1.0 if stop_requested() else 0.0, float(every)], dtype=torch.float64,
                             device=self.rt.device)
        dist.all_reduce(votes)
        stop, every = votes.tolist()
        self.next_check = step + max(1, int(every))  # rank 0's spacing: the same on every rank
        self._since = (step, time.perf_counter())
        return stop > 0
