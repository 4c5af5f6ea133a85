"""Timing a built trainer's steps, or a yardstick's, the way train.py times its own: trainer/metrics/perf.py's
Perf (graphing.StepTimer and the phase's WallWindow), with metrics read at the same cadence as train.log_every.

One timer for every script, so that a script's "step ms" means what results.json's perf/step_ms_* mean (the
interval between the ends of consecutive steps on the device, CUDA events read once after the last step, a
metric read left out) and its wall window what perf/wall_* mean (the first timed step's start to the last one's
end, every metric read between counted): the two sides of a benchmark then report the same measures.
"""
from __future__ import annotations

from typing import Callable, Dict, Optional


def time_window(fn: Callable[[], object], iters: int) -> float:
    """Mean ms per call of ``fn`` (device work: a kernel, a replay) over one window of ``iters`` calls, CUDA events
    at its ends, after the work queued before it has finished."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def time_steps(trainer, steps: int, *, warmup: int = 0, log_every: int = 0,
               read_metrics: Optional[Callable[[], None]] = None) -> Dict[str, float]:
    """Runs ``warmup`` untimed steps, then ``steps`` timed ones (``trainer.next_step()``), and returns the timed
    steps' step_ms_median, step_ms_p90, step_ms_mean, steps_timed and their wall window: wall_s, wall_steps.

    ``read_metrics``: the side's metric read (a host sync), called after every ``log_every``-th step (counted from
    the first, warm-up included), as train.py's loop reads at train.log_every: after the step's end is marked,
    the step timer restarted after it."""
    from trainer.metrics.perf import Perf  # imports torch: not at a script's --help

    perf = Perf(trainer.device, units_per_step=1.0, unit="steps", world_size=1, flops_per_unit=0.0, precision="")
    for number in range(1, warmup + steps + 1):
        phase = "timed" if number > warmup else "warmup"
        perf.begin(phase)  # the first timed step's opens the window, after the work queued so far
        trainer.next_step()
        perf.step(phase)
        if read_metrics is not None and log_every and number % log_every == 0:
            read_metrics()
            perf.timer.restart()
    summary = perf.phase_summary("timed")
    return {key: summary.get(key) for key in ("step_ms_median", "step_ms_p90", "step_ms_mean", "steps_timed",
                                              "wall_s", "wall_steps")}
