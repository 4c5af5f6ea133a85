"""Which checkpoint format: chosen once for what a run writes, told by the path for what it reads.

What a run writes follows from its parallelism (trainer/parallel/parallelism.py) alone: a sharded model
(train.parallel=fsdp2) cannot be gathered whole on one rank, so each rank writes its shards (DCP); a
replicated one is one file. This is the only place in trainer/checkpoint/ that asks whether the run
is sharded; TrainingState asks once and keeps the answer.

What a run reads is whatever the path holds, since a run resumes from, or starts at, a checkpoint of
either kind: a ``.dcp`` directory is DCP's, anything else is read as one file (best.pt, or a file
that ``checkpoint.resume`` or ``checkpoint.init_from`` names).
"""
from __future__ import annotations

from pathlib import Path
from typing import Tuple

from trainer.checkpoint.dcp_shards import DCP_SHARDS
from trainer.checkpoint.format import CheckpointFormat
from trainer.checkpoint.one_file import ONE_FILE
from trainer.parallel.parallelism import Parallelism

FORMATS: Tuple[CheckpointFormat, ...] = (ONE_FILE, DCP_SHARDS)


def format_for(parallelism: Parallelism) -> CheckpointFormat:
    """The format a run of this ``parallelism`` writes its checkpoints in."""
    return DCP_SHARDS if parallelism.sharded else ONE_FILE


def format_of(path: Path) -> CheckpointFormat:
    """The format of the checkpoint at ``path``."""
    return DCP_SHARDS if DCP_SHARDS.holds(path) else ONE_FILE
