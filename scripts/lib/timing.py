"""Timing a built trainer's steps the way train.py times its own: graphing.StepTimer (trainer/metrics/perf.py).

One timer for every script, so that a script's "step ms" means what results.json's perf/step_ms_* mean:
the interval between the ends of consecutive steps on the device (CUDA events, read once after the
last step: no host sync in between; the host clock off CUDA), host waits for data included.
"""
from __future__ import annotations

from typing import Dict


def time_steps(trainer, steps: int) -> Dict[str, float]:
    """Runs ``steps`` training steps (``trainer.next_step()``, after its warm-up) and returns StepTimer's
    summary of them: step_ms_median, step_ms_p90, step_ms_mean, steps_timed."""
    from graphing import StepTimer  # imports torch: not at a script's --help

    timer = StepTimer(trainer.device)  # marks now: the first step's interval starts after the work queued so far
    for _ in range(steps):
        trainer.next_step()
        timer.step("timed")
    timer.collect()
    return timer.summary("timed")
