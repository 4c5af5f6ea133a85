"""When this process started: for the start-up timings and for a run-directory owner's record
(trainer/run_lock.py tells a live owner from a reused pid by it)."""
from __future__ import annotations

import os
import time
from pathlib import Path

_LOADED_AT = time.time()


def process_started_at() -> float:
    """When this process started (Unix time): from /proc on Linux, else when this module loaded."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        ticks = int(fields[19])  # starttime: clock ticks after boot
        boot = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return _LOADED_AT
