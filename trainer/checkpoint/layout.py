"""Where checkpoints live in a run directory, and what they are named: the one place both formats read it.

``<run_dir>/checkpoints/`` holds the run's checkpoints, one per saved step, ``step_<step:08d>`` plus the
format's suffix (``.pt``: one file, trainer/checkpoint/one_file.py; ``.dcp``: a directory of shards,
trainer/checkpoint/dcp_shards.py), and ``best.pt``. The step is zero-padded so that names sort by step up
to 10^8 steps; past that the number is read, not the name (``step_of``).

Everything being written starts with ``TEMP_PREFIX``: it is renamed to its checkpoint name only once
complete, so a name that is not a temp name is never a half-written checkpoint, and whatever starts with
the prefix after a save has finished was left by a killed save (retention removes it).
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import List, Optional

CHECKPOINT_DIR = "checkpoints"
FILE_SUFFIX = ".pt"  # one file (trainer/checkpoint/one_file.py)
SHARDS_SUFFIX = ".dcp"  # a directory of every rank's shards (trainer/checkpoint/dcp_shards.py)
BEST_NAME = "best.pt"  # the best by checkpoint.best_metric; not a step_* name, so never pruned
TEMP_PREFIX = ".tmp_step_"
_STEP_NAME = re.compile(rf"^step_(\d{{8,}})({re.escape(FILE_SUFFIX)}|{re.escape(SHARDS_SUFFIX)})$")


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / CHECKPOINT_DIR


def step_path(run_dir: Path, step: int, suffix: str) -> Path:
    """The checkpoint of ``step`` in ``run_dir``, in the format of ``suffix``."""
    return checkpoint_dir(run_dir) / f"step_{step:08d}{suffix}"


def step_of(path: Path) -> Optional[int]:
    """The step a checkpoint name says (``step_<N>.pt`` or ``step_<N>.dcp``), or None for any other name."""
    m = _STEP_NAME.match(Path(path).name)
    return int(m.group(1)) if m else None


def temp_file_prefix(final: Path) -> str:
    """The prefix of the temp file that becomes the file ``final`` (a unique part follows it)."""
    return f"{TEMP_PREFIX}{final.stem}_"


def temp_dir(run_dir: Path, step: int, suffix: str) -> Path:
    """The directory every rank writes ``step``'s shards into before it is renamed to ``step_path``."""
    return checkpoint_dir(run_dir) / f"{TEMP_PREFIX}{step:08d}{suffix}"


def set_aside(final: Path) -> Path:
    """Where a complete checkpoint of the same name goes while a new one replaces it: a temp name, so a
    crash in between leaves nothing retention would keep."""
    return final.with_name(f"{TEMP_PREFIX}old_{final.name}")


def temps(run_dir: Path) -> List[Path]:
    """Everything in ``run_dir``'s checkpoint folder that has a temp name: being written, or left by a killed save."""
    return list(checkpoint_dir(run_dir).glob(f"{TEMP_PREFIX}*"))
