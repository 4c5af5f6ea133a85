"""Checkpoints of a sharded model (train.parallel=fsdp2): each rank writes its own shards.

A sharded checkpoint is a directory ``<run_dir>/checkpoints/step_<step:08d>.dcp`` written with
``torch.distributed.checkpoint`` (DCP): every rank writes the shards it holds of the model and
the optimizer state (FSDP2's DTensors, keyed by parameter name, through the state-dict helpers
of ``torch.distributed.checkpoint.state_dict``), and rank 0 writes the rest of the training
state (step, every rank's RNG states, the W&B run id, recipe and config) as ``trainer_state.pt``
beside them. No rank ever holds the whole model.

Atomic like a checkpoint file (trainer/checkpoint.py): all ranks write into
``.tmp_step_<step>.dcp``; only once DCP's own finish (its metadata, written last by rank 0 after
every rank's shards) and ``trainer_state.pt`` are on disk and synced does rank 0 rename the
directory to its final name. A directory without both files is not a checkpoint: resume skips
it, retention removes it.

Reading takes any world size and either parallel: DCP re-slices the saved shards into what each
rank now holds (2 ranks → 1, 1 → 2), and a DDP run reads whole tensors from the same directory
(``checkpoint.init_from`` or a resume after switching ``train.parallel``).
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist

from trainer.storage import fsync


SUFFIX = ".dcp"
TRAINER_STATE = "trainer_state.pt"  # rank 0's part: everything but the model's and optimizer's tensors
METADATA = ".metadata"  # DCP's, written last


@dataclass(frozen=True)
class ShardedState:
    """The ``model`` and ``optimizer`` entries of a sharded checkpoint's state: read from its shards into the
    live model or optimizer (``load_model``, ``load_optimizer``), never all at once into memory."""
    path: Path


def is_sharded_checkpoint(path) -> bool:
    """Whether ``path`` is a sharded checkpoint's directory (``step_<N>.dcp``)."""
    return Path(path).suffix == SUFFIX and Path(path).is_dir()


def damage(path: Path) -> Optional[str]:
    """Why the directory ``path`` is not a complete sharded checkpoint, or None."""
    missing = [name for name in (METADATA, TRAINER_STATE) if not (Path(path) / name).is_file()]
    return f"a sharded checkpoint without {' and '.join(missing)}" if missing else None


def read(path: Path) -> Dict[str, Any]:
    """The training state of a sharded checkpoint: ``trainer_state.pt`` (weights_only), with its ``model`` and
    ``optimizer`` entries as ``ShardedState``. Raises OSError or torch's load errors for a damaged one."""
    problem = damage(path)
    if problem:
        raise FileNotFoundError(problem)
    state = torch.load(Path(path) / TRAINER_STATE, map_location="cpu", weights_only=True)
    if isinstance(state, dict):
        state["model"] = state["optimizer"] = ShardedState(Path(path))
    return state


def write_shards(folder: Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 is_main: bool) -> Path:
    """Every rank writes its shards of the model and optimizer state into the temp directory of
    ``folder/step_<step>.dcp`` (a collective), which it returns; ``publish`` then makes it a checkpoint.
    A failure raises on every rank: DCP gathers each rank's outcome before it finishes."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    temp = folder / f".tmp_step_{step:08d}{SUFFIX}"
    if is_main:
        folder.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(temp, ignore_errors=True)  # an earlier attempt's, killed mid-write
        temp.mkdir()
    dist.barrier()
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(temp))
    return temp


def publish(temp: Path, trainer_state: Dict[str, Any]) -> Path:
    """Rank 0: ``trainer_state.pt`` beside the shards, everything synced, then the directory renamed to its
    checkpoint name (``step_<step>.dcp``): only now does it count as a checkpoint."""
    final = temp.with_name(temp.name[len(".tmp_"):])
    try:
        with open(temp / TRAINER_STATE, "wb") as f:
            torch.save(trainer_state, f)
            f.flush()
            os.fsync(f.fileno())
        _fsync_tree(temp)
        if final.exists():
            _replace_dir(temp, final)
        else:
            os.replace(temp, final)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    fsync(final.parent)
    return final


def local_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """The bytes this rank's shards of the model and optimizer state take: what it writes."""
    def size(t: torch.Tensor) -> int:
        local = t.to_local() if hasattr(t, "to_local") else t
        return local.numel() * local.element_size()
    tensors = [*model.parameters(), *model.buffers(),
               *(v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor))]
    return sum(size(t) for t in tensors)


def load_model(model: torch.nn.Module, saved: ShardedState) -> None:
    """The saved model into ``model`` in place: its shards (any world size), or whole tensors for a plain model."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=str(saved.path))
    set_model_state_dict(model, state["model"])


def load_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer, saved: ShardedState) -> None:
    """The saved optimizer state into ``optimizer`` (its tensors re-sliced for this world size)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    state = {"optimizer": get_optimizer_state_dict(model, optimizer)}
    dcp.load(state, checkpoint_id=str(saved.path))
    set_optimizer_state_dict(model, optimizer, state["optimizer"])


def _replace_dir(temp: Path, final: Path) -> None:
    """A complete ``final`` already there (a re-run that saves the same step again): swapped for ``temp``."""
    old = final.with_name(f".tmp_step_old_{final.name}")  # a leftover is a temp: retention removes it
    shutil.rmtree(old, ignore_errors=True)
    os.replace(final, old)
    os.replace(temp, final)
    shutil.rmtree(old, ignore_errors=True)


def _fsync_tree(folder: Path) -> None:
    """Every file DCP and rank 0 wrote, and the folder itself, on disk before the rename publishes them."""
    for path in folder.iterdir():
        if path.is_file():
            fsync(path)
    fsync(folder)
