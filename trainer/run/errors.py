"""How a run ends on purpose: the errors it raises, and every exit code of train.py and of the scripts
that take its config, one meaning each.

The session (trainer/session.py) maps each error to one message and an exit code. The codes are listed
for users in docs/checkpoints.md ("Exit codes"); the doctor's verdicts (scripts/doctor.py) are graphing's
own (graphing/doctor/report.py, 6 and 7), chosen apart from these: tests/test_bad_input.py checks that no
two codes share a value. (No import here: train.py reads the codes before torch is loaded.)
"""
from __future__ import annotations

EXIT_DONE = 0
EXIT_CRASH = 1  # an unexpected error (its traceback in rank<N>.log), or a peer rank died
EXIT_CONFIG = 2  # a setting that cannot work, or a config that does not compose: the message names it
EXIT_CAPTURE = 3  # a CUDA graph capture failed under graph.on_failure=fail (the default; =eager goes on eagerly)
EXIT_NONFINITE = 4  # the training loss became NaN/Inf
EXIT_STORAGE = 5  # a checkpoint, results or metrics write failed (no space, quota, read-only)
# (6 and 7 are the doctor's verdicts, graphing/doctor/report.py)
EXIT_STALLED = 8  # no step finished within train.stall_timeout_s: a peer rank lost or stuck (trainer/run/watchdog.py)
EXIT_INTERRUPTED = 130  # SIGINT (128 + 2)
EXIT_PREEMPTED = 143  # SIGTERM (128 + 15), after a checkpoint

TRAINER_EXIT_CODES = {"done": EXIT_DONE, "crash": EXIT_CRASH, "config": EXIT_CONFIG, "capture": EXIT_CAPTURE,
                      "nonfinite": EXIT_NONFINITE, "storage": EXIT_STORAGE, "stalled": EXIT_STALLED,
                      "interrupted": EXIT_INTERRUPTED,
                      "preempted": EXIT_PREEMPTED}


class ConfigError(Exception):
    """A bad setting. The message names the setting to change; rank 0 prints it once."""


class NonFiniteLossError(RuntimeError):
    """The training loss became NaN or Inf; the last checkpoint (written before it) is kept."""


class Preempted(Exception):
    """The ranks stopped together on SIGTERM, after writing a checkpoint; the same command resumes."""

    def __init__(self, step: int, checkpoint, run_dir):
        if checkpoint is None:  # checkpoint.save=false
            said = (f"stopped on SIGTERM at step {step}, with no checkpoint (checkpoint.save=false): the same command "
                    "starts over")
        else:
            said = (f"stopped on SIGTERM at step {step}, checkpoint written: {checkpoint}. To resume, run the same "
                    f"command with run_dir={run_dir} (checkpoint.resume=auto finds it)")
        super().__init__(said)
        self.step, self.checkpoint = step, checkpoint


class RunDirInUse(ConfigError):
    """Another run owns the run directory (trainer/run/run_lock.py); the message names it. Exit 2: ``run_dir``."""


class StorageError(Exception):
    """A checkpoint, results or metrics write failed for lack of room or rights (trainer/run/storage.py).

    Every rank stops with it at the collective that ends the write; the run exits 5 and the
    message names the path, the bytes needed and free, the last good checkpoint and what to do.
    """

    def __init__(self, message: str, path=None, needed=None, free=None):
        super().__init__(message)
        self.path, self.needed, self.free = path, needed, free


def first_line(e: BaseException) -> str:
    """``Kind: the first line of the message`` (at most 160 characters), for a one-line report."""
    line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return f"{type(e).__name__}: {line[:160]}"
