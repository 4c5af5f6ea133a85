"""The process around a run: what train.py and every script need from the OS, torchrun and Hydra.

Kept apart from the run itself (trainer/session.py) and light to import (no torch at module
level), because train.py calls it before Hydra parses the command line:

- ``quiet_other_ranks`` / ``restore_stderr``: a config error is the same on every rank, so only
  rank 0 prints Hydra's message.
- ``exit_worker``: how a process ends. Under torchrun without interpreter finalization: graphs,
  W&B and the process group are closed explicitly by then (trainer/session.py), and what remains,
  C++ destructors of communication threads, has been seen to abort ("terminate called without an
  active exception") when a peer is already gone.
- ``tell_torchrun``, ``peer_gone``: an error's message in torchrun's failure report, and whether a
  collective lost its peer (another rank's failure, not this one's).
- ``multirun_job_dir``, ``hydra_overrides``: what Hydra says about this job.
- ``quiet_pytree_registrations``: torch's deprecation line for each Enum that torchao registers (on import,
  also through transformers), kept off every rank's console.
- ``process_started_at``: when this process started, for the start-up timings and for a run
  directory owner's record (trainer/run/run_lock.py tells a live owner from a reused pid by it).
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Callable, List, Optional

_LOADED_AT = time.time()

_saved_stderr: Optional[int] = None


def quiet_other_ranks() -> None:
    """Sends every rank's stderr but rank 0's to /dev/null until ``restore_stderr``."""
    global _saved_stderr
    if int(os.environ.get("RANK", "0")) == 0 or _saved_stderr is not None:
        return
    _saved_stderr = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)


def restore_stderr() -> None:
    if _saved_stderr is not None:
        os.dup2(_saved_stderr, 2)


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ


def exit_worker(main: Callable[[], None], after: Callable[[], int] = lambda: 0) -> None:
    """Runs ``main`` (a Hydra entry point, which exits through SystemExit on an error), then ``after``
    (the end of a sweep) for the exit code, and ends the process."""
    try:
        main()
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        # When another rank exits first, torchrun sends this one SIGTERM: the signal thread
        # (trainer/run/stop.py) lets it finish printing its one message rather than dying mid-way.
        if under_torchrun():
            _exit_now(code)
        raise
    code = after()
    if under_torchrun():
        _exit_now(code)
    sys.exit(code)


def _exit_now(code: int) -> None:
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def tell_torchrun(message: str) -> None:
    """Puts ``message`` in torchrun's failure report (its per-worker error file), in place of
    "To enable traceback see ...": the report then names the cause, not only an exit code."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    entry = {"message": message, "extraInfo": {"py_callstack": message, "timestamp": str(int(time.time()))}}
    try:
        with open(path, "w") as f:
            json.dump({"message": entry}, f)
    except OSError:
        pass  # the report falls back to its generic line


def peer_gone(e: BaseException) -> bool:
    """Whether ``e`` says a collective lost its peer (a rank killed or crashed), rather than a bug here."""
    import torch.distributed as dist

    kinds = tuple(k for k in (getattr(dist, "DistNetworkError", None), getattr(dist, "DistBackendError", None)) if k)
    text = str(e)
    return isinstance(e, kinds) or (isinstance(e, RuntimeError) and any(
        mark in text for mark in ("Connection reset by peer", "Connection closed by peer", "gloo/transport/tcp",
                                  "Broken pipe", "NCCL communicator was aborted")))


def multirun_job_dir() -> Optional[str]:
    """Under `train.py -m`, the job's folder of Hydra's sweep directory; None otherwise."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    try:
        hydra_cfg = HydraConfig.get()
    except ValueError:  # composed without @hydra.main
        return None
    return hydra_cfg.runtime.output_dir if hydra_cfg.mode == RunMode.MULTIRUN else None


def hydra_overrides() -> List[str]:
    """The command line's overrides (none when composed without @hydra.main: tests, scripts)."""
    from hydra.core.hydra_config import HydraConfig

    try:
        return list(HydraConfig.get().overrides.task)
    except ValueError:
        return []


def process_started_at() -> float:
    """When this process started (Unix time): from /proc on Linux, else when this module loaded."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        ticks = int(fields[19])  # starttime: clock ticks after boot
        boot = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return _LOADED_AT


@contextlib.contextmanager
def quiet_pytree_registrations():
    """Around an import of torchao (or of transformers, which imports it where installed): torch 2.14 answers each
    Enum that torchao registers with its pytree with a deprecation line, on every rank; not this run's business."""
    pytree_log = logging.getLogger("torch.utils._pytree")
    level = pytree_log.level
    pytree_log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        pytree_log.setLevel(level)
