"""Where metrics go: metrics.jsonl in the run directory, and Weights & Biases.

Rank 0 logs (``logger.wandb.all_ranks=true``: every rank logs a W&B run of its own,
grouped, so a slow or diverging rank can be seen). W&B runs offline unless ``logger.wandb.mode`` or ``WANDB_MODE`` says
otherwise, so nothing waits for a network or a key; ``wandb sync <run_dir>/wandb/...``
uploads later. A W&B failure at any point is reported once and logging carries on to
the JSONL file: it never stops training.

W&B runs in a process of its own (trainer/metrics/wandb_sidecar.py): importing wandb and
starting its run take seconds of Python work, which on a thread of this process would
hold the GIL and slow every step it overlaps. This process only queues each call; a
thread pipes it to the sidecar, which replays the calls in order once W&B is up.
``finish`` waits for the sidecar to finish the run (``logger.wandb.init_timeout_s``, plus
time to write the run's files), and never longer: a stuck W&B cannot hang the exit.
"""
from __future__ import annotations

import errno
import json
import os
import pickle
import queue
import random
import string
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from trainer.metrics import wandb_sidecar
from trainer.run import storage
from trainer.run.errors import StorageError
from trainer.metrics.wandb_sidecar import FAILURE_HINT

SIDECAR = Path(wandb_sidecar.__file__)  # run as a script: it imports the standard library and wandb only
FINISH_GRACE_S = 60.0  # beyond the start timeout: writing and closing the run's files


class MetricsLogger:
    def __init__(self, cfg_logger, run_dir: Path, config: Dict[str, Any], *, rank: int, job_type: str,
                 run_id: Optional[str] = None, enabled: bool = True):
        """``run_id``: rank 0's W&B run to continue (resume); ``enabled=False`` logs nothing."""
        self.enabled = enabled and rank == 0  # metrics.jsonl and the summaries
        self._jsonl = JsonLines(run_dir / "metrics.jsonl") if self.enabled else None
        wandb_cfg = cfg_logger.wandb
        use_wandb = enabled and cfg_logger.backend.value == "wandb" and (rank == 0 or wandb_cfg.all_ranks)
        # Chosen here, not by W&B, so that a checkpoint written before W&B is up still names its run.
        self.run_id: Optional[str] = (run_id if rank == 0 and run_id else new_run_id()) if use_wandb else None
        self._sidecar: Optional[WandbSidecar] = None
        if use_wandb:
            init = wandb_init_kwargs(wandb_cfg, run_dir, config, job_type, rank, self.run_id,
                                     resuming=run_id is not None)
            self._sidecar = WandbSidecar(init, timeout_s=float(wandb_cfg.init_timeout_s) + FINISH_GRACE_S)

    def log(self, metrics: Dict[str, Any], step: int) -> None:
        if self._jsonl is not None:
            self._jsonl.append({"step": step, "time": time.time(), **metrics})
        if self._sidecar is not None:
            self._sidecar.send("log", {"step": step, **metrics})

    def summary(self, values: Dict[str, Any]) -> None:
        if self._jsonl is not None:
            self._jsonl.append({"summary": values, "time": time.time()})
        if self._sidecar is not None:
            self._sidecar.send("summary", dict(values))

    def write_pending(self) -> None:
        """Appends the rows a failed write left in memory; raises StorageError if they still cannot be written."""
        if self._jsonl is not None:
            self._jsonl.write_pending()

    def table(self, key: str, columns: List[str], rows: List[List[Any]], bar: Optional[tuple] = None) -> None:
        """A W&B table (and optionally a bar chart of column ``bar[1]`` by ``bar[0]``)."""
        if self._sidecar is not None:
            self._sidecar.send("table", key, list(columns), [list(r) for r in rows], bar)

    def finish(self, exit_code: int = 0) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._sidecar is not None:
            self._sidecar.finish(exit_code)
            self._sidecar = None


def wandb_init_kwargs(cfg, run_dir: Path, config: Dict[str, Any], job_type: str, rank: int, run_id: str,
                      resuming: bool) -> Dict[str, Any]:
    """``wandb.init``'s arguments for this rank."""
    name, group = cfg.name, cfg.group
    if cfg.all_ranks:  # one run per rank, grouped by job
        name, group = f"{cfg.name or run_dir.name}-rank{rank}", cfg.group or run_dir.name
    return dict(project=cfg.project, entity=cfg.entity, group=group, name=name, tags=list(cfg.tags),
                job_type=cfg.job_type or job_type, config=config, dir=str(run_dir), mode=wandb_mode(cfg), id=run_id,
                resume="allow" if resuming else None, init_timeout_s=float(cfg.init_timeout_s))


def wandb_mode(cfg) -> str:
    """``logger.wandb.mode``, else WANDB_MODE, else offline: nothing waits for a network or a key."""
    return cfg.mode.value if cfg.mode is not None else os.environ.get("WANDB_MODE") or "offline"


class WandbSidecar:
    """The W&B process and the thread that pipes calls to it; sending never blocks training."""

    def __init__(self, init: Dict[str, Any], timeout_s: float):
        self.timeout_s = timeout_s
        self._queue: "queue.SimpleQueue[Optional[tuple]]" = queue.SimpleQueue()
        self._failed = False
        try:
            self._process: Optional[subprocess.Popen] = subprocess.Popen(
                [sys.executable, str(SIDECAR)], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)})
        except OSError as e:
            self._report(f"start its process ({type(e).__name__}: {e})")
            self._process = None
            return
        self._pipe = threading.Thread(target=self._pump, name="wandb-pipe", daemon=True)
        self._pipe.start()
        self.send("start", init)

    def send(self, kind: str, *args: Any) -> None:
        if self._process is not None:
            self._queue.put((kind, *args))

    def _pump(self) -> None:
        stdin = self._process.stdin
        try:
            while True:
                message = self._queue.get()
                if message is None:
                    break
                pickle.dump(message, stdin, protocol=pickle.HIGHEST_PROTOCOL)
                stdin.flush()
        except (OSError, ValueError, pickle.PicklingError) as e:  # the sidecar died (and said why), or bad data
            if not isinstance(e, BrokenPipeError):
                self._report(f"take a call ({type(e).__name__}: {e})")
        finally:
            try:
                stdin.close()
            except OSError:
                pass

    def finish(self, exit_code: int) -> None:
        if self._process is None:
            return
        self.send("finish", exit_code)
        self._queue.put(None)
        deadline = time.monotonic() + self.timeout_s
        self._pipe.join(timeout=self.timeout_s)
        try:
            self._process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:  # a stuck W&B must not hang the exit
            self._report(f"finish within {self.timeout_s:g} s (logger.wandb.init_timeout_s plus "
                         f"{FINISH_GRACE_S:g} s); it was stopped")
            self._process.kill()
        self._process = None

    def _report(self, what: str) -> None:
        if not self._failed:
            self._failed = True
            print(f"[logger] W&B could not {what}; {FAILURE_HINT}", file=sys.stderr, flush=True)


def new_run_id() -> str:
    """A W&B run id (8 lowercase letters and digits), made without importing wandb."""
    return "".join(random.SystemRandom().choice(string.ascii_lowercase + string.digits) for _ in range(8))


class JsonLines:
    """metrics.jsonl, appended one whole row at a time; a row that cannot be written waits in memory.

    Only rank 0 of the run directory's owner (trainer/run/run_lock.py) appends, so a failed write
    can be cut back to the last whole row: a full disk never leaves half a row. A file that
    already ends in half a row (a crash, a power loss) gets a line break first, so that the
    bad row stays one unreadable line and every new row is whole. Rows that fail (no space,
    quota, read-only) are kept in memory in order, retried with the next row, and written
    before the next checkpoint (``write_pending``), where a lasting failure stops the run
    (trainer/run/storage.py).
    """

    def __init__(self, path: Path):
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        self._pending: List[bytes] = []
        self._warned = False
        if self._ends_in_half_a_row():
            print(f"[logger] {path} ends in an incomplete row (a crash while writing it); it stays as one "
                  "unreadable line and new rows start on the next line", file=sys.stderr, flush=True)
            self._pending.append(b"\n")

    def _ends_in_half_a_row(self) -> bool:
        size = os.fstat(self._fd).st_size
        if size == 0:
            return False
        with open(self.path, "rb") as f:  # another descriptor of this file: no lock lives on it
            f.seek(size - 1)
            return f.read(1) != b"\n"

    def append(self, row: Dict[str, Any]) -> None:
        self._pending.append((json.dumps(row) + "\n").encode())
        try:
            self.write_pending()
        except StorageError as e:  # said once, retried with the next row and before the next checkpoint
            if not self._warned:
                self._warned = True
                print(f"[logger] {e}; rows are kept in memory and written before the next checkpoint",
                      file=sys.stderr, flush=True)

    def write_pending(self) -> None:
        while self._pending and self._fd is not None:
            data = self._pending[0]
            size = os.fstat(self._fd).st_size
            try:
                written = os.write(self._fd, data)
                if written != len(data):
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            except OSError as e:
                try:
                    os.ftruncate(self._fd, size)  # never half a row
                except OSError:
                    pass
                if not storage.is_storage_failure(e):
                    raise
                raise storage.failure("metrics rows to", self.path, sum(map(len, self._pending)), e) from None
            self._pending.pop(0)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
