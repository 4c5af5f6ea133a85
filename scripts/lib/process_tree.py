"""Finding and ending every process of one run, whatever its parent or session.

torchrun's elastic agent starts each rank in a session of its own, so a signal to the launched process, or
to its process group, misses the ranks: a killed torchrun orphans them, and on a GPU machine they keep the
GPUs. What every process of a run does share is its environment: a launch puts a marker in it (``MARK``),
which torchrun's ranks, their loader workers and W&B inherit. Linux only (/proc); elsewhere nothing is found.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from pathlib import Path
from typing import Dict, List, Mapping, Set, Tuple

MARK = "GRAPHED_DDP_RUN_MARK"  # its value: the markers of the runs a process belongs to, comma-separated


def marked(env: Mapping[str, str]) -> Tuple[Dict[str, str], str]:
    """``env`` with a new marker added, and that marker. Added to any ``env`` already holds (a run started by
    a run), so that ending the outer run finds the inner run's processes too."""
    mark = uuid.uuid4().hex
    return {**env, MARK: ",".join(filter(None, (env.get(MARK), mark)))}, mark


def is_live(pid: int) -> bool:
    """Neither gone nor a zombie (dead, waiting for its parent to reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def marked_pids(mark: str) -> List[int]:
    """The live processes, this one aside, whose environment carries ``mark``."""
    prefix = f"{MARK}=".encode()
    try:
        entries = [int(e) for e in os.listdir("/proc") if e.isdigit() and int(e) != os.getpid()]
    except OSError:
        return []
    found = []
    for pid in entries:
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:  # gone, or another user's
            continue
        values = [v[len(prefix):].decode(errors="replace") for v in environ.split(b"\0") if v.startswith(prefix)]
        if any(mark in value.split(",") for value in values) and is_live(pid):
            found.append(pid)
    return found


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
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
        if proc.poll() is None:  # no /proc to find it by
            proc.kill()
        proc.wait()
    return len(ended)
