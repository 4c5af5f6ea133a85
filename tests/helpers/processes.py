"""Finding a launch's processes and saying what they are doing.

Every process a launch starts (torchrun, ranks, loader workers, W&B) carries the variable ``MARK``, valued
"<this pytest session>-<the launch>": found by it, whatever its parent or session.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path
from typing import Dict, List, Optional, Tuple

MARK = "GRAPHED_DDP_TEST_LAUNCH"
SESSION = uuid.uuid4().hex[:12]  # this pytest session: the start of every marker it hands out
# The warm server's folder (helpers/warm.py): its socket, and ``forks/<pid>`` for each process it forked,
# holding that launch's mark and command line (a fork's /proc environ and cmdline are the server's).
WARM_DIR = Path(tempfile.gettempdir()) / f"graphed_ddp_test_warm_{SESSION}"


def process_state(pid: int) -> Optional[str]:
    """The kernel's one-letter state of a process (R, S, D, Z for a zombie, ...); None once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def is_live(pid: int) -> bool:
    """Neither gone nor a zombie (dead, not yet reaped by its parent)."""
    return process_state(pid) not in (None, "Z")


def warm_forks() -> Dict[int, Tuple[str, str]]:
    """The warm server's forks this session that are alive or whose session may still be, by pid: (their
    launch's mark, their command line). A pid the system gave again to a new process is not one of them."""
    forks = {}
    try:
        entries = list((WARM_DIR / "forks").iterdir())
    except OSError:
        return forks
    for entry in entries:
        try:
            mark, argv, started = entry.read_text().split("\n")
        except (OSError, ValueError):
            continue
        pid = int(entry.name)
        now = _stat(pid, 19)
        if now is None or now == int(started):  # gone (its session's processes may remain), or still it
            forks[pid] = (mark, argv)
    return forks


def _stat(pid: int, field: int) -> Optional[int]:
    """A numeric field of /proc/PID/stat, counted from the state after the command's name (3: session id,
    19: start time)."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[field])
    except (OSError, IndexError, ValueError):
        return None


def marked_pids(value: str, prefix: bool = False) -> List[int]:
    """Live (not zombie) processes whose environment holds ``MARK=value`` (or a value starting with it), and
    the processes of every warm fork's session whose launch had that mark (each fork is a session's leader)."""
    needle = f"{MARK}={value}".encode()
    sessions = {pid for pid, (mark, _) in warm_forks().items()
                if mark == value or (prefix and mark.startswith(value))}
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes()
        except OSError:
            continue
        marked = any(v == needle or (prefix and v.startswith(needle)) for v in environ.split(b"\0"))
        if (marked or (sessions and _stat(int(entry), 3) in sessions)) and is_live(int(entry)):
            found.append(int(entry))
    return found


def cmdline(pid: int) -> str:
    """A process's command line (its first 200 characters), "(gone)" once it is. A warm fork's, and that of a
    process it forked, read as the server's: they are named by the command line the fork's client gave."""
    try:
        line = Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ").strip()
    except OSError:
        return "(gone)"
    session = _stat(pid, 3) if "warm_python.py" in line else None
    fork = warm_forks().get(session) if session is not None else None
    if fork is not None:
        line = f"(warm fork{'' if session == pid else ', a process it forked'}) {fork[1]}"
    return line[:200]


def wait_state(pid: int) -> str:
    """The kernel's view of a process: its state and what it waits in (wchan)."""
    state = process_state(pid)
    try:
        return "gone" if state is None else f"state {state}, waiting in {Path(f'/proc/{pid}/wchan').read_text() or '-'}"
    except OSError:
        return "gone"


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
