"""Finding checkpoints: whether a path names one; a run's, oldest step first; the newest one that loads.

Both formats make one series, ordered by step: a run that switched ``train.parallel`` resumes from
the newest checkpoint whichever kind it is. A checkpoint can be damaged after it was written (a disk
or a copy truncated it): ``latest_checkpoint`` skips one that does not load, with a warning that
names it, and falls back to the one before, rather than stop the run or start it over.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from trainer.checkpoint.choice import FORMATS, format_of
from trainer.checkpoint.dcp_shards import DCP_SHARDS
from trainer.checkpoint.unreadable import UnreadableCheckpoint, short_cause

log = logging.getLogger(__name__)


def checkpoint_exists(path) -> bool:
    """Whether ``path`` (``checkpoint.resume``, ``checkpoint.init_from``) is there to be read: a sharded checkpoint's
    directory, or any file, read as one file whatever its name (``choice.format_of``). Whether it loads is
    found by reading it."""
    return DCP_SHARDS.holds(path) or Path(path).is_file()


def list_checkpoints(run_dir: Path) -> List[Path]:
    """Checkpoints of ``run_dir`` (files and sharded directories), oldest step first (temp names excluded)."""
    return [p for _, p in sorted(found for fmt in FORMATS for found in fmt.find(run_dir))]


def load_checkpoint(path: Path) -> Dict[str, Any]:
    """Loads one checkpoint onto the CPU with ``weights_only=True`` (a sharded one: its training state, its
    model and optimizer read later, into the live ones: ``CheckpointFormat.load_model``); raises
    UnreadableCheckpoint on a bad one."""
    try:
        state = format_of(path).read(path)
    except Exception as e:  # torch.load raises many types for a damaged file
        raise UnreadableCheckpoint(path, short_cause(e)) from e
    if not isinstance(state, dict) or "step" not in state:
        raise UnreadableCheckpoint(path, "no training state (a dict with a 'step')")
    return state


def latest_checkpoint(run_dir: Path) -> Optional[Tuple[Path, Dict[str, Any]]]:
    """The newest readable checkpoint of ``run_dir`` and its state, or None.

    Unreadable files (truncated, corrupt, not a checkpoint) are skipped with a warning
    that names them; the next older one is tried.
    """
    for path in reversed(list_checkpoints(run_dir)):
        try:
            return path, load_checkpoint(path)
        except UnreadableCheckpoint as e:
            log.warning("skipping unreadable checkpoint %s (%s); trying the previous one", path, e.cause)
    return None
