"""Retention: each checkpoint a run writes joins the series, which is then cut to the newest ``checkpoint.keep``.

Only complete checkpoints count toward ``keep`` (each format judges its own: ``CheckpointFormat.damage``):
a truncated newest file must not push out the good one a resume falls back to. Damaged ones are removed,
so that one newer than this run's last save (a run that resumed from an older checkpoint, past a
truncated newer one, and ended before reaching its step) can never outrank this run's newest checkpoint
on the next ``resume=auto``. The checkpoint just written always stays, even when newer complete ones of
an earlier run fill ``keep``. Temp names left by a killed save go too: pruning follows a finished save,
so none is live.
"""
from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Callable

from trainer.checkpoint.choice import format_of
from trainer.checkpoint.find import list_checkpoints
from trainer.checkpoint.layout import temps
from trainer.checkpoint.unreadable import short_cause
from trainer.run.errors import ConfigError

log = logging.getLogger(__name__)


def add_checkpoint(run_dir: Path, keep: int, write: Callable[[], Path]) -> Path:
    """The checkpoint ``write()`` makes (and returns), then the newest ``keep`` of ``run_dir`` kept."""
    if keep < 1:
        raise ConfigError(f"checkpoint.keep={keep} must be at least 1: set checkpoint.keep=2")
    written = write()
    prune(run_dir, keep, written)
    return written


def prune(run_dir: Path, keep: int, written: Path) -> None:
    """Keeps the newest ``keep`` complete checkpoints and ``written``; removes damaged ones and temp names."""
    complete = []
    for path in reversed(list_checkpoints(run_dir)):  # newest first
        if path == written:
            complete.append(path)
            continue
        try:
            damage = format_of(path).damage(path)
        except OSError as e:  # cannot even read it (permissions, I/O): neither counted nor removed
            log.warning("cannot inspect checkpoint %s (%s); leaving it in place", path, short_cause(e))
            continue
        if damage is None:
            complete.append(path)
        else:
            log.warning("removing unreadable checkpoint %s (%s)", path, damage)
            _remove(path)
    for old in complete[keep:]:
        if old != written:
            _remove(old)
    for stale in temps(run_dir):
        _remove(stale)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
