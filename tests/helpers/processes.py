"""Finding a launch's processes and saying what they are doing.

Every process a launch starts (torchrun, ranks, loader workers, W&B) carries the variable ``MARK``, valued
"<this pytest session>-<the launch>": found by it, whatever its parent or session.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from pathlib import Path
from typing import List, Optional

MARK = "GRAPHED_DDP_TEST_LAUNCH"
SESSION = uuid.uuid4().hex[:12]  # this pytest session: the start of every marker it hands out


def process_state(pid: int) -> Optional[str]:
    """The kernel's one-letter state of a process (R, S, D, Z for a zombie, ...); None once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def is_live(pid: int) -> bool:
    """Neither gone nor a zombie (dead, not yet reaped by its parent)."""
    return process_state(pid) not in (None, "Z")


def marked_pids(value: str, prefix: bool = False) -> List[int]:
    """Live (not zombie) processes whose environment holds ``MARK=value`` (or a value starting with it)."""
    needle = f"{MARK}={value}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes()
        except OSError:
            continue
        if any(v == needle or (prefix and v.startswith(needle)) for v in environ.split(b"\0")) and is_live(int(entry)):
            found.append(int(entry))
    return found


def cmdline(pid: int) -> str:
    """A process's command line (its first 200 characters), "(gone)" once it is."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ").strip()[:200]
    except OSError:
        return "(gone)"


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
