"""The other half of the stall watchdog (trainer/run/watchdog.py): a small process beside each rank that ends the
rank when the rank itself cannot act.

A rank that a signal stopped (SIGSTOP, a frozen node), or that is stuck in a C call holding the GIL, runs no thread
of its own: its watchdog cannot say anything or exit. Its guard can: the rank's watchdog thread writes a byte to the
guard's stdin every second while the rank runs Python; no byte for ``timeout`` seconds, and the guard prints why,
kills the rank (SIGKILL reaches a stopped process) and exits. torchrun then sees a worker die and ends the others,
and ``--max-restarts`` (or the scheduler's requeue) starts the job again from its last checkpoint. The rank's end,
however it comes, closes the pipe: the guard exits at once, so it never outlives the job.

Standard library only: it starts in tens of milliseconds and holds no GPU.

    python -m trainer.run.stall_guard PID RANK TIMEOUT_S
"""
from __future__ import annotations

import os
import select
import signal
import sys
import time


def guard(pid: int, rank: str, timeout_s: float, stdin_fd: int = 0) -> int:
    last = time.monotonic()
    while True:
        ready, _, _ = select.select([stdin_fd], [], [], max(0.05, timeout_s - (time.monotonic() - last)))
        if ready:
            try:
                data = os.read(stdin_fd, 4096)
            except OSError:
                data = b""
            if not data:  # the rank ended: its pipe closed
                return 0
            last = time.monotonic()
            continue
        waited = time.monotonic() - last
        if waited < timeout_s:
            continue
        print(f"rank {rank} (pid {pid}) has run no Python for {waited:.0f} s (stopped, or stuck in a call that "
              f"holds the GIL): ending it so that its launcher ends the job (the guard waits {timeout_s:g} s, twice "
              "train.stall_timeout_s)",
              file=sys.stderr, flush=True)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    pid, rank, timeout_s = int(argv[0]), argv[1], float(argv[2])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the rank's to handle; its end closes the pipe
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    return guard(pid, rank, timeout_s)


if __name__ == "__main__":
    sys.exit(main())
