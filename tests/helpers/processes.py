"""Marking a launch's processes, and saying what they are doing.

Every process a launch starts (torchrun, ranks, loader workers, W&B) carries the run marker of
scripts/lib/process_tree.py (``MARK``) with two markers in it: this pytest session's (``SESSION``) and the
launch's own; ``marked_pids`` (process_tree's, the one finder) finds them by either. A warm fork
(helpers/warm_python.py) carries them too: it writes its launch's environment where /proc shows it.
"""
from __future__ import annotations

import shutil
import subprocess
import uuid
from pathlib import Path
from typing import Dict, List, Mapping, Tuple

import psutil

from scripts.lib.process_tree import MARK, is_live, marked, marked_pids

__all__ = ["MARK", "SESSION", "WARM_COMMAND", "cmdline", "is_live", "launch_marked", "marked_pids", "stacks"]

SESSION = uuid.uuid4().hex[:12]  # this pytest session: a marker every launch's processes carry
# Where a warm fork keeps the command its client was given (its /proc cmdline is its server's): named by it.
WARM_COMMAND = "GRAPHED_DDP_TEST_WARM_COMMAND"


def launch_marked(env: Mapping[str, str]) -> Tuple[Dict[str, str], str]:
    """``env`` marked as this session's and as a new launch's; that launch's marker."""
    return marked({**env, MARK: ",".join(filter(None, (env.get(MARK), SESSION)))})


def cmdline(pid: int) -> str:
    """A process's command line (its first 200 characters), "(gone)" once it is. A warm fork, and a process it
    forked, is named by the command its client was given."""
    try:
        proc = psutil.Process(pid)
        line = " ".join(proc.cmdline())
        command = proc.environ().get(WARM_COMMAND) if "warm_python.py" in line else None
    except psutil.Error:
        return "(gone)"
    return (f"(warm fork) {command}" if command else line)[:200]


def wait_state(pid: int) -> str:
    """The kernel's view of a process: its state and what it waits in (wchan)."""
    try:
        state = psutil.Process(pid).status()
        wchan = Path(f"/proc/{pid}/wchan").read_text()  # psutil does not say where a process sleeps
    except (psutil.Error, OSError):
        return "gone"
    return f"state {state}, waiting in {wchan or '-'}"


def stacks(pids: List[int]) -> str:
    """Where each process is (py-spy, where installed): what a hung launch reports before it is killed."""
    spy = shutil.which("py-spy")
    lines = []
    for pid in pids:
        lines.append(f"--- pid {pid} ({wait_state(pid)}): {cmdline(pid)}")
        if spy:
            try:
                dump = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=20)
                lines.append((dump.stdout + dump.stderr).strip())
            except (OSError, subprocess.SubprocessError) as e:
                lines.append(f"(py-spy: {e})")
    if not spy:
        lines.append("(pip install py-spy to see their stacks here)")
    return "\n".join(lines)
