"""One owner per run directory (trainer/run/run_lock.py), checked in one process and its children.

Two real launches into one directory are a row of tests/test_fault_table.py; here: what the
lock does when its owner dies, when a DataLoader-style fork child outlives its owner, and the
fallback on a filesystem that refuses locks.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from helpers.paths import ROOT
from trainer.run.errors import RunDirInUse
from trainer.run.run_lock import LOCK_NAME, acquire, read_owner

pytestmark = pytest.mark.fast

HOLD = """
import os, sys, time
sys.path.insert(0, {root!r})
from pathlib import Path
from trainer.run.run_lock import acquire
lock = acquire(Path({run_dir!r}))
if {fork}:
    if os.fork() == 0:  # a DataLoader worker: it inherits the descriptor, not the lock
        time.sleep(30)
        os._exit(0)
print("held", flush=True)
time.sleep(30)
"""


def _holder(run_dir, fork=False):
    proc = subprocess.Popen([sys.executable, "-c", HOLD.format(root=str(ROOT), run_dir=str(run_dir), fork=fork)],
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_owner_is_refused_with_the_owner_named_and_a_dead_owner_is_taken_over(tmp_path):
    run_dir = tmp_path / "run"
    proc = _holder(run_dir)
    try:
        before = sorted(p.name for p in run_dir.iterdir())
        with pytest.raises(RunDirInUse) as err:
            acquire(run_dir)
        message = str(err.value)
        assert f"run_dir={run_dir} is in use by another run: pid {proc.pid} on host" in message
        assert "since" in message and "set run_dir=..." in message
        assert sorted(p.name for p in run_dir.iterdir()) == before == [LOCK_NAME]
    finally:
        proc.send_signal(signal.SIGKILL)  # no teardown: the owner file stays, the kernel drops the lock
        proc.wait()
    assert read_owner(run_dir).pid == proc.pid  # the dead owner's record is still there ...
    lock = acquire(run_dir)  # ... and no timeout is needed to take over
    assert read_owner(run_dir).pid == os.getpid()
    with pytest.raises(RunDirInUse, match="another session of this process"):
        acquire(run_dir)  # opening the file twice would drop the lock on close
    lock.release()
    assert not (run_dir / LOCK_NAME).exists()


def test_a_fork_child_that_outlives_the_owner_does_not_hold_the_directory(tmp_path):
    run_dir = tmp_path / "run"
    proc = _holder(run_dir, fork=True)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    try:
        acquire(run_dir).release()  # the child still has the descriptor open: record locks are per process
    finally:
        os.killpg(proc.pid, signal.SIGKILL)


def test_a_claim_that_ends_before_the_run_opens_its_directory_leaves_nothing(tmp_path):
    run_dir = tmp_path / "outputs" / "day" / "run"
    acquire(run_dir).release(remove_dirs=True)
    assert not (tmp_path / "outputs").exists()


def _no_locks(monkeypatch):
    def refuse(fd, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "lockf", refuse)


def _record(run_dir, **fields):
    run_dir.mkdir(parents=True, exist_ok=True)
    owner = {"host": "vm", "pid": os.getpid(), "since": time.time(), "started": 0.0, "job": "none", "attempt": 0}
    owner.update(fields)
    (run_dir / LOCK_NAME).write_text(json.dumps(owner))


def test_without_locks_a_live_owner_on_this_host_is_refused_and_a_dead_one_taken_over(tmp_path, monkeypatch):
    import socket

    from trainer.run.process import process_started_at

    _no_locks(monkeypatch)
    run_dir = tmp_path / "run"
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        started = float(open(f"/proc/{live.pid}/stat").read().rsplit(")", 1)[1].split()[19])
        boot = next(int(line.split()[1]) for line in open("/proc/stat") if line.startswith("btime"))
        _record(run_dir, host=socket.gethostname(), pid=live.pid, started=boot + started / os.sysconf("SC_CLK_TCK"))
        with pytest.raises(RunDirInUse, match="by its owner record: this filesystem refuses file locks"):
            acquire(run_dir)
    finally:
        live.kill()
        live.wait()
    lock = acquire(run_dir)  # the recorded pid is gone
    assert not lock.locked and read_owner(run_dir).pid == os.getpid()
    lock.release()
    # A reused pid (alive, but started later than the record says) is not the owner either.
    _record(run_dir, host=socket.gethostname(), pid=os.getpid(), started=process_started_at() - 1000)
    acquire(run_dir).release()


def test_without_locks_an_owner_on_another_host_needs_an_explicit_take_over(tmp_path, monkeypatch):
    _no_locks(monkeypatch)
    run_dir = tmp_path / "run"
    _record(run_dir, host="node7", pid=1234)
    with pytest.raises(RunDirInUse) as err:
        acquire(run_dir)
    assert "pid 1234 on host node7" in str(err.value) and "take_over_run_dir=true" in str(err.value)
    acquire(run_dir, take_over=True).release()
    # An earlier attempt of the same torchrun job (a restart on another node) is taken over without it.
    _record(run_dir, host="node7", pid=1234, job="job-1", attempt=0)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    acquire(run_dir).release()
