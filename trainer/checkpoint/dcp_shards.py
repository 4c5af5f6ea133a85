"""Sharded checkpoints (``step_<N>.dcp``): a sharded model's (train.parallel=fsdp2), each rank writing its own shards.

The checkpoint is a directory written with ``torch.distributed.checkpoint`` (DCP): every rank writes the
shards it holds of the model and the optimizer state (FSDP2's DTensors, keyed by parameter name, through
the state-dict helpers of ``torch.distributed.checkpoint.state_dict``), and rank 0 writes the rest of
the training state (step, every rank's RNG states, the W&B run id, recipe and config) as
``trainer_state.pt`` beside them. No rank ever holds the whole model.

Atomic like a one-file checkpoint: all ranks write into a temp directory (trainer/checkpoint/layout.py);
only once DCP's own finish (its metadata, written last by rank 0 after every rank's shards) and
``trainer_state.pt`` are on disk and synced does rank 0 rename the directory to its final name. A
directory without both files is not a checkpoint: resume skips it, retention removes it.

Reading takes any world size and either parallel: ``read`` returns the training state with a
``ShardedState`` (where the shards are) for its model and optimizer, and ``load_model`` /
``load_optimizer`` have DCP re-slice the saved shards into what each rank now holds (2 ranks → 1,
1 → 2), or whole tensors into a plain model (``checkpoint.init_from``, or a resume after switching
``train.parallel``). The other way round, a one-file checkpoint's whole tensors go into the shards
here (``load_whole_model``, ``load_whole_optimizer``).
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from trainer.run import storage
from trainer.checkpoint.format import CheckpointFormat, Ranks
from trainer.checkpoint.layout import SHARDS_SUFFIX, set_aside, step_path, temp_dir
from trainer.run.errors import StorageError
from graphing.sharded import local_tensor

TRAINER_STATE = "trainer_state.pt"  # rank 0's part: everything but the model's and optimizer's tensors
METADATA = ".metadata"  # DCP's, written last


@dataclass(frozen=True)
class ShardedState:
    """The ``model`` and ``optimizer`` entries of a sharded checkpoint's state: the directory their shards are
    read from, into the live model or optimizer (``DcpShards.load_model``), never all at once into memory."""
    path: Path


class DcpShards(CheckpointFormat):
    suffix = SHARDS_SUFFIX
    is_dir = True

    def stage(self, ranks: Ranks, run_dir: Path, step: int, model: torch.nn.Module,
              optimizer: torch.optim.Optimizer) -> Path:
        """Every rank writes its shards into the temp directory, which it returns, once all agree there is room
        for them: a rank that stopped alone would leave the others waiting in DCP's collectives."""
        final = step_path(run_dir, step, self.suffix)
        mine = local_bytes(model, optimizer)
        ranks.on_every_rank(lambda: storage.check_room("checkpoint", final, storage.HEADROOM + mine))
        try:
            return _write_shards(temp_dir(run_dir, step, self.suffix), model, optimizer, ranks.is_main)
        except Exception as e:  # DCP gathers every rank's outcome: every rank raises alike
            cause = next((c for c in (e, *_failures(e)) if storage.is_storage_failure(c)), None)
            if cause is None:
                raise
            said = str(storage.failure("checkpoint", final, mine, cause))
            raise StorageError(ranks.storage_advice(said)) from None

    def write(self, run_dir: Path, step: int, staged: Path, extra: Dict[str, Any]) -> Path:
        """Rank 0: ``trainer_state.pt`` beside the shards, everything synced, then the directory renamed to its
        checkpoint name: only now does it count as a checkpoint."""
        final = step_path(run_dir, step, self.suffix)
        try:
            _publish(staged, final, extra)
        except Exception as e:
            if storage.is_storage_failure(e):
                raise storage.failure("checkpoint", staged, storage.nbytes(extra) + storage.HEADROOM, e) from None
            raise
        return final

    def read(self, path: Path) -> Dict[str, Any]:
        """``trainer_state.pt`` (weights_only), its ``model`` and ``optimizer`` entries a ``ShardedState``."""
        problem = self.damage(path)
        if problem:
            raise FileNotFoundError(problem)
        state = torch.load(Path(path) / TRAINER_STATE, map_location="cpu", weights_only=True)
        if isinstance(state, dict):
            state["model"] = state["optimizer"] = ShardedState(Path(path))
        return state

    def load_model(self, model: torch.nn.Module, saved: ShardedState, live: CheckpointFormat) -> None:
        """Its shards into ``model`` (any world size), or whole tensors into a plain one: DCP reads what each
        rank's ``model`` holds, so ``live`` is not needed."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
        set_model_state_dict(model, _read_shards(saved.path, "model", get_model_state_dict(model)))

    def load_optimizer(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, saved: ShardedState,
                       live: CheckpointFormat) -> None:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
        set_optimizer_state_dict(model, optimizer,
                                 _read_shards(saved.path, "optimizer", get_optimizer_state_dict(model, optimizer)))

    def damage(self, path: Path) -> Optional[str]:
        missing = [name for name in (METADATA, TRAINER_STATE) if not (Path(path) / name).is_file()]
        return f"a sharded checkpoint without {' and '.join(missing)}" if missing else None

    # Whole tensors of a sharded model: for best.pt (one file, written by rank 0) and for reading a one-file
    # checkpoint (torch's own state_dict keys) into the shards.

    def whole_model_state(self, model: torch.nn.Module) -> Dict[str, Any]:
        """A collective whose result is rank 0's only (other ranks get an empty dict), gathered into host memory."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict
        return get_model_state_dict(model, options=_full_options(cpu_offload=True))

    def load_whole_model(self, model: torch.nn.Module, state: Dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict
        set_model_state_dict(model, state, options=_full_options())

    def load_whole_optimizer(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                             saved: Dict[str, Any]) -> None:
        """torch's numbered form renamed to DCP's parameter names, each whole tensor cut into this rank's shard."""
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict
        names = _names_in_order(model, optimizer)
        by_name = {"state": {names[i]: value for i, value in saved["state"].items()},
                   "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in saved["param_groups"]]}
        set_optimizer_state_dict(model, optimizer, by_name, options=_full_options())


DCP_SHARDS = DcpShards()


def local_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """The bytes this rank's shards of the model and optimizer state take: what it writes."""
    def size(t: torch.Tensor) -> int:
        local = local_tensor(t)
        return local.numel() * local.element_size()
    tensors = [*model.parameters(), *model.buffers(),
               *(v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor))]
    return sum(size(t) for t in tensors)


def _write_shards(temp: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, is_main: bool) -> Path:
    """Every rank's shards of the model and optimizer state into ``temp`` (a collective). A failure raises on
    every rank: DCP gathers each rank's outcome before it finishes."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    if is_main:
        temp.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(temp, ignore_errors=True)  # an earlier attempt's, killed mid-write
        temp.mkdir()
    dist.barrier()
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(temp))
    return temp


def _read_shards(path: Path, key: str, mine: Dict[str, Any]) -> Dict[str, Any]:
    """``mine`` (this rank's state dict of the checkpoint's ``key`` entry) filled from the shards at ``path``,
    re-sliced for what this rank holds (every rank calls it)."""
    import torch.distributed.checkpoint as dcp
    state = {key: mine}
    dcp.load(state, checkpoint_id=str(path))
    return state[key]


def _failures(e: BaseException) -> List[BaseException]:
    """The ranks' own exceptions inside DCP's CheckpointException (each wrapped with its traceback)."""
    failures = getattr(e, "failures", None) or {}
    return [getattr(f, "exception", f) for f in failures.values() if isinstance(getattr(f, "exception", f),
                                                                                  BaseException)]


def _publish(temp: Path, final: Path, trainer_state: Dict[str, Any]) -> None:
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
    storage.fsync(final.parent)


def _replace_dir(temp: Path, final: Path) -> None:
    """A complete ``final`` already there (a re-run that saves the same step again): swapped for ``temp``."""
    old = set_aside(final)  # a leftover has a temp name: retention removes it
    shutil.rmtree(old, ignore_errors=True)
    os.replace(final, old)
    os.replace(temp, final)
    shutil.rmtree(old, ignore_errors=True)


def _fsync_tree(folder: Path) -> None:
    """Every file DCP and rank 0 wrote, and the folder itself, on disk before the rename publishes them."""
    for path in folder.iterdir():
        if path.is_file():
            storage.fsync(path)
    storage.fsync(folder)


def _full_options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    return StateDictOptions(full_state_dict=True, **kw)


def _names_in_order(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> List[str]:
    """The parameter names of the optimizer's groups, in the order torch's own state_dict numbers them."""
    names = {}
    for name, p in model.named_parameters():
        names.setdefault(id(p), name)  # a tied parameter: its first name
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
