"""The expected gain of a graph: how long an eager step takes, and how much of it the GPU is busy
(a launch-bound step gains the most)."""
from __future__ import annotations

import statistics
import time
from typing import Callable, Optional

import torch

PROFILE_STEPS = 3


def median_step_ms(run: Callable[[], None], count: int, device: torch.device, side) -> float:
    """Median eager step time in ms (CUDA events on the current stream, or the host clock)."""
    times = []
    for _ in range(count):
        if side is not None:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record(torch.cuda.current_stream(device))
            run()
            end.record(torch.cuda.current_stream(device))
            end.synchronize()
            times.append(begin.elapsed_time(end))
        else:
            start = time.perf_counter()
            run()
            times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def gpu_busy_ms(run: Callable[[], None], device: torch.device) -> Optional[float]:
    """Summed kernel and copy time per step, from a short torch.profiler profile."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(PROFILE_STEPS):
                run()
            torch.cuda.synchronize(device)
        busy_us = sum(e.device_time for e in prof.events() if e.device_type == DeviceType.CUDA)
    except Exception:  # a profiler that cannot start (another one running) leaves the gain unmeasured
        return None
    return busy_us / 1e3 / PROFILE_STEPS
