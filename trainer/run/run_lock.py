"""One owner per run directory: rank 0 holds ``<run_dir>/owner.lock`` for the run's whole life.

The same command started twice into one ``run_dir`` (two terminals, a requeued job whose
first copy still runs) would otherwise train twice into one directory: both runs' rows in
metrics.jsonl, checkpoints interleaved. ``acquire`` is called by rank 0 when the ranks agree
on the run directory (trainer/run/runtime.py ``start``), before anything is written there; the
other ranks learn the outcome in the same broadcast, so all ranks of one job are one owner.
A second launch exits with ``RunDirInUse`` (exit 2, one message naming the owner's host, pid
and start time), having written nothing into the directory.

How, and what is guaranteed where:
- Filesystems with POSIX record locks (local disks; NFS with its lock manager; Lustre, GPFS
  and BeeGFS mounted with locking): ``fcntl.lockf`` on ``owner.lock``. The kernel (or the NFS
  server) releases the lock when the owning process ends in any way, SIGKILL and power loss
  included, so a new launch or a torchrun restart of the same job takes the directory over
  at once, without a timeout guess. The lock is exclusive: at most one owner, ever.
  Record locks belong to the process, not to an open file: DataLoader workers forked from
  rank 0 do not inherit them (``flock`` locks would be shared with the workers and could
  outlive a killed rank 0). The price: closing ANY descriptor of the file drops the
  process's lock, so the owner opens it exactly once (a second session of this process
  for the same directory is refused here, before it could open it again); other processes
  read the owner record written into the file.
- Filesystems that refuse locks (``ENOLCK``, ``EOPNOTSUPP``: NFS mounted ``nolock``, some
  FUSE filesystems): the owner record in ``owner.lock`` is the claim. An owner on this host
  is checked for life (its pid exists and started when the record says); a dead one is
  taken over. An owner on another host cannot be checked from here: the launch is refused
  unless ``take_over_run_dir=true`` (set it once you know that run has ended), or unless it
  is an earlier attempt of the same torchrun job (same rendezvous id, lower restart count).
  Not guaranteed there: two launches that check the record at the same instant can both
  pass (a record is not a lock).
The file is removed when the owner ends normally; after a crash it stays, naming the dead
owner, and is taken over by the next launch as above.
"""
from __future__ import annotations

import datetime
import errno
import fcntl
import json
import logging
import os
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, List, Optional

from trainer.run.errors import RunDirInUse
from trainer.run.process import process_started_at

log = logging.getLogger(__name__)

LOCK_NAME = "owner.lock"
_NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS}
_HELD: Dict[str, "RunDirLock"] = {}  # by real path: this process's own run directories


@dataclass
class Owner:
    host: str
    pid: int
    since: float  # Unix time the lock was taken
    started: float  # the pid's process start time: a reused pid is not mistaken for the owner
    job: str  # torchrun's rendezvous id, "none" outside torchrun
    attempt: int  # torchrun's restart count

    @classmethod
    def me(cls) -> "Owner":
        return cls(socket.gethostname(), os.getpid(), time.time(), process_started_at(),
                   os.environ.get("TORCHELASTIC_RUN_ID", "none"), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))

    def describe(self) -> str:
        since = datetime.datetime.fromtimestamp(self.since).astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")
        return f"pid {self.pid} on host {self.host}, since {since}"


class RunDirLock:
    """This process's claim on one run directory; ``release`` gives it back (once)."""

    def __init__(self, run_dir: Path, fd: int, locked: bool, created: List[Path]):
        self.run_dir, self.path = run_dir, run_dir / LOCK_NAME
        self._fd: Optional[int] = fd
        self.locked = locked  # False: the filesystem refused locks, the record is the claim
        self.created = created  # directories this claim made, outermost first

    def release(self, remove_dirs: bool = False) -> None:
        """Removes the owner file, then drops the lock (closing the descriptor). ``remove_dirs``: the run
        never opened its directory (a config error while building), so directories this claim made go too."""
        if self._fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)  # while still held: a waiting launch then finds no stale record
        except OSError as e:
            log.warning("could not remove %s (%s)", self.path, e.strerror)
        os.close(self._fd)
        self._fd = None
        _HELD.pop(os.path.realpath(self.run_dir), None)
        if remove_dirs:
            for folder in reversed(self.created):
                try:
                    folder.rmdir()  # only if empty: another run may have come in meanwhile
                except OSError:
                    break


def acquire(run_dir: Path, take_over: bool = False) -> RunDirLock:
    """Claims ``run_dir`` (creating it if needed) for this process; raises RunDirInUse if another run holds it."""
    run_dir = Path(run_dir)
    key = os.path.realpath(run_dir)
    if key in _HELD:  # opening the file again would drop this process's lock on close
        raise RunDirInUse(f"run_dir={run_dir} is in use by another session of this process "
                          f"(pid {os.getpid()}): set run_dir=... to another directory")
    created = _make_dirs(run_dir)
    path = run_dir / LOCK_NAME
    for _ in range(10):
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            locked = True
        except OSError as e:
            if e.errno in (errno.EACCES, errno.EAGAIN):
                os.close(fd)  # this process holds no lock on the file: closing costs nothing
                raise RunDirInUse(_in_use(run_dir, _read_owner(path), locked=True)) from None
            if e.errno not in _NO_LOCKS:
                os.close(fd)
                raise
            locked = False
            _check_record(run_dir, fd, take_over)
        if not _same_file(fd, path):  # the previous owner removed the file between our open and lock
            os.close(fd)
            created += _make_dirs(run_dir)
            continue
        record = json.dumps(asdict(Owner.me())).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, record, 0)
        os.fsync(fd)
        held = _HELD[key] = RunDirLock(run_dir, fd, locked, created)
        if not locked:
            log.warning("the filesystem of %s refuses file locks: the owner record guards the run directory, "
                        "which two launches at the same instant could both pass", run_dir)
        return held
    raise RunDirInUse(f"run_dir={run_dir}: its owner file {path} keeps being replaced: another launch is "
                      "starting there; set run_dir=... to another directory")


def read_owner(run_dir: Path) -> Optional[Owner]:
    """The owner record of ``run_dir`` (a live owner's, or a crashed one's), or None."""
    return _read_owner(Path(run_dir) / LOCK_NAME)


def _read_owner(path: Path) -> Optional[Owner]:
    try:
        return _parse(path.read_bytes())
    except OSError:
        return None


def _parse(raw: bytes) -> Optional[Owner]:
    try:
        return Owner(**json.loads(raw.decode()))
    except (ValueError, TypeError, UnicodeDecodeError):
        return None  # empty: an owner that has not written its record yet, or released


def _in_use(run_dir: Path, owner: Optional[Owner], locked: bool) -> str:
    who = owner.describe() if owner else "a run that is starting (its owner record is not written yet)"
    how = "" if locked else " (by its owner record: this filesystem refuses file locks)"
    stop = f" (kill {owner.pid} on {owner.host})" if owner else ""
    return (f"run_dir={run_dir} is in use by another run: {who}{how}. Wait for that run to end or stop it{stop}; "
            "or set run_dir=... to a new directory")


def _check_record(run_dir: Path, fd: int, take_over: bool) -> None:
    """Without locks: refuses if the record names an owner that may be alive."""
    owner = _parse(os.pread(fd, 4096, 0))
    if owner is None:
        return
    me = Owner.me()
    if owner.host == me.host:
        if _alive(owner):
            os.close(fd)
            raise RunDirInUse(_in_use(run_dir, owner, locked=False))
        log.warning("taking over %s from its dead owner (%s)", run_dir, owner.describe())
        return
    if take_over or (owner.job == me.job != "none" and owner.attempt < me.attempt):
        log.warning("taking over %s from %s", run_dir, owner.describe())
        return
    os.close(fd)
    raise RunDirInUse(
        f"run_dir={run_dir} has an owner on another host: {owner.describe()}; this filesystem refuses file locks, "
        f"so whether it still runs cannot be told from here. Once you know it has ended, set take_over_run_dir=true; "
        "or set run_dir=... to a new directory")


def _alive(owner: Owner) -> bool:
    try:
        os.kill(owner.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:  # the same pid, but a later process? (pids are reused)
        fields = Path(f"/proc/{owner.pid}/stat").read_text().rsplit(")", 1)[1].split()
        boot = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime"))
        return abs(boot + int(fields[19]) / os.sysconf("SC_CLK_TCK") - owner.started) < 2.0
    except (OSError, ValueError, IndexError, StopIteration):
        return True  # cannot tell: assume alive


def _same_file(fd: int, path: Path) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _make_dirs(run_dir: Path) -> List[Path]:
    """Creates ``run_dir`` and missing parents; returns those it made, outermost first."""
    missing = []
    folder = run_dir
    while not folder.exists() and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    made = []
    for folder in reversed(missing):
        try:
            folder.mkdir()
            made.append(folder)
        except FileExistsError:
            pass
    return made
