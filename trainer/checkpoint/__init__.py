"""Checkpoints: what a run saves, in which format, where, how many are kept, and resuming from them.

A checkpoint is one of two formats behind one protocol (``CheckpointFormat``, format.py): one file that
rank 0 writes, ``step_<N>.pt`` (one_file.py), for a plain model; or a directory into which every rank
writes its own shards, ``step_<N>.dcp`` (dcp_shards.py), for a sharded model (train.parallel=fsdp2),
which no rank can hold whole. The format a run writes is chosen once (choice.py); the format of a
checkpoint read is told by its path, since a run resumes from either kind. Reading goes through the same
protocol as writing: the format read puts what it read into the live model and optimizer, in place,
whatever format the live model writes (so a DDP run starts from a sharded checkpoint and back).

    layout.py         names in the run directory: step_<N>.pt / .dcp, best.pt, the temp prefix
    format.py         the protocol: stage (every rank) + write (rank 0), read + load into live ones, damage, find
    one_file.py       the one-file format (and best.pt, one file in either format)
    dcp_shards.py     the sharded format, through torch.distributed.checkpoint
    choice.py         which format: the run's (writing), a path's (reading)
    find.py           whether a path names a checkpoint; a run's checkpoints in step order; the newest that loads
    retention.py      a new checkpoint joins the series, cut to the newest checkpoint.keep
    compatibility.py  whether a checkpoint may resume this run (recipe, epoch length)
    restore.py        a checkpoint's model and optimizer into the live ones, in place (the lr tensor kept)
    rng.py            every process's RNG states, saved and restored
    unreadable.py     UnreadableCheckpoint: a one-line cause, never torch's advice to unpickle
    state.py          TrainingState: what a run saves, saving it on every rank, resuming it
    export.py         checkpoint.export's directory: the record of whose export it is, a re-run's decision

Every write goes to a temp name and is renamed once complete, so after a crash at any point a
checkpoint name holds a complete checkpoint or nothing; one damaged later (a truncated file) is
skipped by a resume and removed by retention, never counted toward ``checkpoint.keep``.
"""
from trainer.checkpoint.choice import FORMATS, format_for, format_of
from trainer.checkpoint.compatibility import check_compatible, check_same_epochs
from trainer.checkpoint.dcp_shards import DCP_SHARDS
from trainer.checkpoint.find import checkpoint_exists, latest_checkpoint, list_checkpoints, load_checkpoint
from trainer.checkpoint.format import CheckpointFormat
from trainer.checkpoint.layout import BEST_NAME, CHECKPOINT_DIR, TEMP_PREFIX, checkpoint_dir
from trainer.checkpoint.one_file import ONE_FILE, save_best
from trainer.checkpoint.restore import load_model_state, load_optimizer_state
from trainer.checkpoint.rng import rng_state, set_rng_state
from trainer.checkpoint.state import TrainingState
from trainer.checkpoint.unreadable import UnreadableCheckpoint

__all__ = ["BEST_NAME", "CHECKPOINT_DIR", "CheckpointFormat", "DCP_SHARDS", "FORMATS", "ONE_FILE", "TEMP_PREFIX",
           "TrainingState", "UnreadableCheckpoint", "check_compatible", "check_same_epochs", "checkpoint_dir",
           "checkpoint_exists", "format_for", "format_of", "latest_checkpoint", "list_checkpoints", "load_checkpoint",
           "load_model_state", "load_optimizer_state", "rng_state", "save_best", "set_rng_state"]
