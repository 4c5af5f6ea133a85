"""One-file checkpoints (``step_<N>.pt``): a plain model's training state, written whole by rank 0.

The file holds one dict of plain tensors, python containers and primitives only, so it loads with
``torch.load(weights_only=True)``: loading a checkpoint never runs pickled code. Every rank of a DDP
run holds the same model and optimizer state, so rank 0 alone writes it. best.pt is such a file in
either format (whole weights; a sharded model's gathered to rank 0 first).

Foot-guns handled here:
- A crash (or a killed rank) in the middle of ``torch.save`` must not leave a file that looks like a
  checkpoint: writes go to a temp file in the same directory, are fsynced, then renamed over the final
  name (``os.replace`` is atomic within one filesystem).
- A file can still be truncated afterwards by the disk or a copy: ``damage`` tells from the file's
  tail, without loading it, so retention never counts it (trainer/checkpoint/retention.py).
- ``torch.save`` can fail without an errno once the disk fills: the room is checked first, and a
  failed write becomes a StorageError naming the path and sizes (trainer/run/storage.py).
"""
from __future__ import annotations

import os
import tempfile
import zipfile
from pathlib import Path
from typing import Any, Callable, Dict, Optional

import torch

from trainer.run import storage
from trainer.checkpoint.format import CheckpointFormat, Ranks
from trainer.checkpoint.layout import BEST_NAME, FILE_SUFFIX, checkpoint_dir, step_path, temp_file_prefix
from trainer.checkpoint.unreadable import short_cause
from trainer.run.stop import writing


class OneFile(CheckpointFormat):
    suffix = FILE_SUFFIX
    is_dir = False

    def stage(self, ranks: Ranks, run_dir: Path, step: int, model: torch.nn.Module,
              optimizer: torch.optim.Optimizer) -> Callable[[], Dict[str, Any]]:
        """Nothing on every rank: rank 0 takes its (replicated) model and optimizer state as it writes."""
        return lambda: {"model": model.state_dict(), "optimizer": optimizer.state_dict()}

    def write(self, run_dir: Path, step: int, staged: Callable[[], Dict[str, Any]], extra: Dict[str, Any]) -> Path:
        return write_atomically(step_path(run_dir, step, self.suffix), {**staged(), **extra})

    def read(self, path: Path) -> Dict[str, Any]:
        """The whole file; its ``model`` and ``optimizer`` entries are torch's own state dicts of whole tensors."""
        return torch.load(path, map_location="cpu", weights_only=True)

    def load_model(self, model: torch.nn.Module, saved: Dict[str, Any], live: CheckpointFormat) -> None:
        live.load_whole_model(model, saved)

    def load_optimizer(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, saved: Dict[str, Any],
                       live: CheckpointFormat) -> None:
        live.load_whole_optimizer(model, optimizer, saved)

    def damage(self, path: Path) -> Optional[str]:
        """Judged from the zip central directory: ``torch.save`` writes a zip archive whose central directory
        is the last thing in the file, so a truncated (or zero-filled, or foreign) file has none, which
        ``zipfile`` finds by reading the file's tail; ``torch.load`` would take seconds per GB."""
        try:
            with zipfile.ZipFile(path) as archive:
                names = archive.namelist()
        except OSError:
            raise
        except Exception as e:  # zipfile.BadZipFile mostly; a garbled directory can raise others
            return f"not a complete zip archive: {short_cause(e)}"
        if not any(name == "data.pkl" or name.endswith("/data.pkl") for name in names):
            return "a zip archive without torch's data.pkl"
        return None

    def whole_model_state(self, model: torch.nn.Module) -> Dict[str, Any]:
        return model.state_dict()

    def load_whole_model(self, model: torch.nn.Module, state: Dict[str, Any]) -> None:
        model.load_state_dict(state)

    def load_whole_optimizer(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                             saved: Dict[str, Any]) -> None:
        optimizer.load_state_dict(saved)


ONE_FILE = OneFile()


def save_best(run_dir: Path, state: Dict[str, Any]) -> Path:
    """Writes ``state`` as ``run_dir/checkpoints/best.pt`` atomically (not a step name: retention leaves it)."""
    return write_atomically(checkpoint_dir(run_dir) / BEST_NAME, state)


def write_atomically(final: Path, state: Dict[str, Any]) -> Path:
    """torch.save to a temp file in the same folder, fsync, rename: never a partial file under ``final``.

    The room is checked first (the tensors' bytes against the filesystem's free bytes), so a full
    disk is refused before writing; a write that fails anyway (quota, another writer filled the
    disk, read-only) removes its temp file and becomes a StorageError naming the path and sizes.
    """
    folder = final.parent
    needed = storage.nbytes(state) + storage.HEADROOM
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise (storage.failure("checkpoint", final, needed, e) if storage.is_storage_failure(e) else e) from None
    storage.check_room("checkpoint", final, needed)
    temp_name = None
    try:
        fd, temp_name = tempfile.mkstemp(prefix=temp_file_prefix(final), suffix=FILE_SUFFIX, dir=folder)
        with writing(temp_name), os.fdopen(fd, "wb") as f:  # a Ctrl-C meanwhile removes it
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
            os.replace(temp_name, final)
    except BaseException as e:
        if temp_name is not None:
            try:
                Path(temp_name).unlink(missing_ok=True)
            except OSError:
                pass
        if isinstance(e, Exception) and storage.is_storage_failure(e):
            raise storage.failure("checkpoint", final, needed, e) from None
        raise
    storage.fsync(folder)  # the rename itself survives a power loss only once the directory is synced
    return final
