"""scripts/lib/train_runs.py's TreeUsage: the host memory and the busy cores of every process a benchmark's run
started, read from plain interpreters marked as a launch marks them."""
from __future__ import annotations

import os
import subprocess
import sys

from scripts.lib import process_tree
from scripts.lib.train_runs import TreeUsage

BUSY = "import time\nend = time.process_time() + 2.5\nwhile time.process_time() < end: pass\n"


def test_a_busy_marked_process_shows_as_a_busy_core_and_its_memory_counts():
    env, mark = process_tree.marked(dict(os.environ))
    with TreeUsage(mark) as tree:
        busy = subprocess.Popen([sys.executable, "-c", BUSY], env=env)
        try:
            busy.wait(timeout=60)
        finally:
            busy.kill()
    assert busy.returncode == 0
    # One process spinning for 2.5 s of CPU: its busiest sampled second kept about one core busy (a loaded
    # 2-core machine may give it less than all of one; never near two)
    assert 0.5 < tree.peak_cores < 1.5, tree.peak_cores
    assert 2 < tree.peak_mib < 500, tree.peak_mib  # an interpreter's proportional share


def test_no_marked_process_is_no_busy_core():
    _, mark = process_tree.marked(dict(os.environ))
    with TreeUsage(mark) as tree:
        subprocess.run([sys.executable, "-c", BUSY.replace("2.5", "1.5")], timeout=60, check=True)  # unmarked
    assert tree.peak_cores == 0 and tree.peak_mib == 0


PARENT_WAITS_FOR_A_BUSY_CHILD = ("import subprocess, sys\n"
                                 f"subprocess.run([sys.executable, '-c', {BUSY!r}], check=True)\n")


def test_the_launched_process_own_cores_leave_its_childrens_out():
    """A launched process that waits while its child spins (a rank waiting for its loader workers): the tree kept
    about a core busy, the launched process itself about none; a launched process that spins: about one of its own.
    (Lower bounds loose: the suite's other work may share this machine's two cores with the spinning one.)"""
    env, mark = process_tree.marked(dict(os.environ))
    with TreeUsage(mark) as waits:
        subprocess.run([sys.executable, "-c", PARENT_WAITS_FOR_A_BUSY_CHILD], env=env, timeout=60, check=True)
    tree, own = waits.cores_between(waits.samples[0][0], waits.samples[-1][1])
    assert 0.3 < tree < 1.5 and own < 0.2, waits.samples
    with TreeUsage(mark) as spins:
        subprocess.run([sys.executable, "-c", BUSY], env=env, timeout=60, check=True)
    tree, own = spins.cores_between(spins.samples[0][0], spins.samples[-1][1])
    assert 0.3 < own < 1.5 and abs(tree - own) < 0.2, spins.samples


def test_the_cores_between_two_times_are_those_of_the_samples_inside_them():
    """A window over the spinning second half of a run reads about one core where the idle first half reads none
    (a benchmark's timed steps after its start-up); a window shorter than a sample reads the nearest one."""
    env, mark = process_tree.marked(dict(os.environ))
    idle_then_busy = f"import time\ntime.sleep(2.5)\n{BUSY}"
    with TreeUsage(mark) as usage:
        subprocess.run([sys.executable, "-c", idle_then_busy], env=env, timeout=60, check=True)
    first, last = usage.samples[0][0], usage.samples[-1][1]
    assert usage.cores_between(first, first + 2.0)[0] < 0.2, usage.samples
    assert 0.3 < usage.cores_between(last - 2.0, last)[0] < 1.5, usage.samples
    assert usage.cores_between(last - 0.1, last - 0.05)[0] > 0.3, usage.samples
    assert TreeUsage(mark).cores_between(first, last) == (0.0, 0.0)
