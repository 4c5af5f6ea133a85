"""How a rank's DataLoader workers behave: the host loader's, and those that read a dataset whole
for the device loader (trainer/data/items.py).

A worker ends when its rank says so, or when its rank is gone; never on a signal of its own.
"""
from __future__ import annotations

import ctypes
import functools
import os
import signal
import sys
from typing import Callable, Optional

import torch

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _worker_init(forked_from: Optional[int], _worker_id: int) -> None:
    """SIGINT and SIGTERM stay blocked here, as in the rank's threads (trainer/stop.py): they reach a
    whole process group (Ctrl-C, torchrun stopping its ranks, SLURM preemption), and a worker ended
    by one makes DataLoader raise in its rank ("worker killed by signal") wherever the rank is, in the
    middle of an orderly SIGTERM stop too. The rank stops in its own time and then shuts its workers down.

    A worker forked from its rank (``forked_from``: the rank's pid) also holds copies of the rank's
    sockets (gloo's connections to the other ranks among them). Left running after its rank dies, it
    would keep those connections open until DataLoader's watchdog noticed the parent was gone (every
    5 s), and the other ranks would wait that long to learn that this one is gone. On Linux it is
    killed with its rank instead: strictly, when the thread that started it ends, so the loaders are
    iterated from one long-lived thread (the training loop's). (A worker started by spawn or
    forkserver inherits no sockets.)
    """
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    if forked_from is not None and sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):  # no prctl here: the watchdog's 5 s it is
            return
        if os.getppid() != forked_from:  # the rank died before the line above
            os._exit(1)


def _forking_pid() -> Optional[int]:
    """This process's pid where DataLoader workers fork from it (torch's default start method is fork
    on Linux up to Python 3.13), else None."""
    mp = torch.multiprocessing  # the start method as set, else the default (listed first), without fixing it
    return os.getpid() if (mp.get_start_method(allow_none=True) or mp.get_all_start_methods()[0]) == "fork" else None


def worker_init_fn() -> Callable[[int], None]:
    """DataLoader's ``worker_init_fn`` for workers started from this process (the rank)."""
    return functools.partial(_worker_init, _forking_pid())
