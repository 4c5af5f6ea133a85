"""Finding and ending every process of one run, whatever its parent or session: the one process finder of
this repo's scripts and tests.

torchrun's elastic agent starts each rank in a session of its own, so a signal to the launched process, or
to its process group, misses the ranks: a killed torchrun orphans them, and on a GPU machine they keep the
GPUs. What every process of a run does share is its environment: a launch puts a marker in it (``MARK``),
which torchrun's ranks, their loader workers and W&B inherit. psutil reads the environments (on Linux from
/proc; where it cannot, nothing is found).
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from typing import Dict, Iterable, List, Mapping, Set, Tuple

import psutil

MARK = "GRAPHED_DDP_RUN_MARK"  # its value: the markers of the runs a process belongs to, comma-separated


def marked(env: Mapping[str, str]) -> Tuple[Dict[str, str], str]:
    """``env`` with a new marker added, and that marker. Added to any ``env`` already holds (a run started by
    a run), so that ending the outer run finds the inner run's processes too."""
    mark = uuid.uuid4().hex
    return {**env, MARK: ",".join(filter(None, (env.get(MARK), mark)))}, mark


def is_live(pid: int) -> bool:
    """Neither gone nor a zombie (dead, waiting for its parent to reap it)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def marked_pids(mark: str) -> List[int]:
    """The live processes, this one aside, whose environment carries ``mark``."""
    found = []
    for proc in psutil.process_iter():
        if proc.pid == os.getpid():
            continue
        try:
            if mark in proc.environ().get(MARK, "").split(",") and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc.pid)
        except psutil.Error:  # gone, a zombie, or another user's
            continue
    return found


def kill(pids: Iterable[int], sig: int = signal.SIGKILL) -> None:
    """``sig`` (SIGKILL by default) to each of ``pids`` still there."""
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def end(proc: subprocess.Popen, mark: str, grace: float) -> int:
    """Ends every process of the run that ``proc`` (started in a session of its own, ``mark`` in its
    environment) began; returns how many there were. SIGTERM to ``proc``'s process group first, so that
    torchrun can stop its ranks itself; ``grace`` s later (at once on a second interrupt), SIGKILL to every
    process still carrying ``mark``, ranks in sessions of their own included. Reaps ``proc``."""
    ended: Set[int] = set(marked_pids(mark))
    try:
        if proc.returncode is None:  # not reaped: its pid, the group's id, is still its own
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        while (proc.poll() is None or marked_pids(mark)) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        deadline = time.monotonic() + 5
        while (left := marked_pids(mark)) and time.monotonic() < deadline:
            ended.update(left)
            kill(left)
            time.sleep(0.1)
        if proc.poll() is None:  # unmarked where its environment cannot be read
            proc.kill()
        proc.wait()
    return len(ended)
