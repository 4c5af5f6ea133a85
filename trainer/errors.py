"""The errors a run ends with on purpose; the session (trainer/session.py) maps each to one message and an
exit code, for train.py and every script."""


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
    """Another run owns the run directory (trainer/run_lock.py); the message names it. Exit 2: ``run_dir``."""


class StorageError(Exception):
    """A checkpoint, results or metrics write failed for lack of room or rights (trainer/storage.py).

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
