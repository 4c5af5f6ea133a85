"""A run's log records: held in memory until the run directory exists, then each rank's rank<N>.log;
rank 0's console shows warnings (synthetic data, W&B, graph fallbacks) once."""
from __future__ import annotations

import logging
import logging.handlers
import sys
from typing import List


def start_logging(is_main: bool) -> List[logging.Handler]:
    """The root logger's handlers for this run: [records kept until the run directory exists,
    rank 0's console for warnings]."""
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    logging.captureWarnings(True)
    held = logging.handlers.MemoryHandler(capacity=100_000, flushLevel=logging.CRITICAL + 1)
    root.addHandler(held)
    if not is_main:
        return [held]
    console = logging.StreamHandler(sys.stderr)
    console.setLevel(logging.WARNING)
    root.addHandler(console)
    return [held, console]


def log_to_file(path, held: logging.handlers.MemoryHandler) -> None:
    """From here on the rank's records go to ``path``, beginning with those held so far."""
    handler = _QuietFileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    held.setTarget(handler)
    held.flush()
    held.flushLevel = logging.DEBUG  # pass every later record straight through
    held.capacity = 1


def stop_logging(handlers: List[logging.Handler]) -> None:
    """Removes and closes the run's handlers: a second run in this process (tests, notebooks) logs to its own files."""
    for handler in handlers:
        logging.getLogger().removeHandler(handler)
        target = getattr(handler, "target", None)
        handler.close()
        if target is not None:
            target.close()


class _QuietFileHandler(logging.FileHandler):
    """A rank's log file that a full disk cannot turn into tracebacks: a failed record is said once.

    (logging's default prints "--- Logging error ---" and a traceback for every record.)
    """

    _said = False

    def handleError(self, record) -> None:
        if not self._said:
            self._said = True
            from trainer.run.runtime import print_once

            print_once(f"[logger] cannot write {self.baseFilename} ({sys.exc_info()[1]}); its records are lost "
                       "from here", file=sys.stderr)
