"""Checkpoints: atomic save, keep the newest K, find the newest readable one, resume safely.

A checkpoint is ``<run_dir>/checkpoints/step_<step:08d>.pt`` holding one dict of plain
tensors, python containers and primitives only, so it loads with
``torch.load(weights_only=True)``: loading a checkpoint never runs pickled code. A sharded
model's (train.parallel=fsdp2) is the directory ``step_<step:08d>.dcp``, each rank's shards
written by that rank (trainer/sharded_checkpoint.py); both kinds are listed, kept, skipped when
damaged and resumed the same way here.

Foot-guns this module handles or names:
- A crash (or a killed rank) in the middle of ``torch.save`` must not leave a file that
  looks like a checkpoint: writes go to a temp file in the same directory, are fsynced,
  then renamed over the final name (``os.replace`` is atomic within one filesystem).
- A file can still be truncated by the disk or a copy: ``latest_checkpoint`` skips
  unreadable files with a warning and falls back to the previous one, and retention
  (``save_checkpoint``) counts only complete files toward ``keep`` and removes the others,
  so a damaged file never displaces a good one (nor outranks the newest good one next time).
- ``torch.load``'s errors end in advice to retry with ``weights_only=False``, i.e. to run
  the pickled code of a damaged or foreign file: ``UnreadableCheckpoint`` carries a one-line
  cause without it.
- ``Optimizer.load_state_dict`` replaces each param group's ``lr`` with the saved
  object. Our lr is a device tensor that a captured CUDA graph reads by address, so
  ``load_optimizer_state`` copies the saved values into the live tensors instead.
- RNG states are per process; ``rng_state`` captures only the calling process's
  (trainer/state.py gathers every rank's).
"""
from __future__ import annotations

import logging
import os
import random
import re
import shutil
import tempfile
import zipfile
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

from trainer import sharded_checkpoint, sharding, storage
from trainer.errors import ConfigError
from trainer.stop import writing

log = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoints"
BEST_NAME = "best.pt"  # the best by checkpoint.best_metric; not a step_*.pt, so never pruned
_NAME = re.compile(r"^step_(\d{8,})\.(pt|dcp)$")  # a file, or a sharded checkpoint's directory
_TEMP_PREFIX = ".tmp_step_"


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / CHECKPOINT_DIR


def list_checkpoints(run_dir: Path) -> List[Path]:
    """Checkpoint files of ``run_dir``, oldest step first (temp files excluded)."""
    folder = checkpoint_dir(run_dir)
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir()
             if (m := _NAME.match(p.name)) and (p.is_dir() if m.group(2) == "dcp" else p.is_file())]
    return [p for _, p in sorted(found)]


def save_checkpoint(run_dir: Path, step: int, state: Dict[str, Any], keep: int) -> Path:
    """Writes ``state`` as ``run_dir/checkpoints/step_{step:08d}.pt`` atomically; keeps the newest ``keep``.

    Call it on one rank only (rank 0): every rank holds the same DDP state. After a
    crash at any point, the directory holds either the old or the new file, never a
    partial one under a checkpoint name.
    """
    if keep < 1:
        raise ConfigError(f"checkpoint.keep={keep} must be at least 1: set checkpoint.keep=2")
    folder = checkpoint_dir(run_dir)
    final = _write_atomically(folder / f"step_{step:08d}.pt", state)
    _prune(folder, run_dir, keep, written=final)
    return final


def write_sharded_checkpoint(run_dir: Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                             is_main: bool) -> Path:
    """Every rank writes its shards of a sharded model's checkpoint for ``step`` (a collective, before rank 0's
    ``publish_sharded_checkpoint``); returns the temp directory. A storage failure is a StorageError on every rank."""
    folder = checkpoint_dir(run_dir)
    try:
        return sharded_checkpoint.write_shards(folder, step, model, optimizer, is_main)
    except Exception as e:
        causes = [e, *_failures(e)]
        if any(storage.is_storage_failure(c) for c in causes):
            raise storage.failure("checkpoint", folder / f"step_{step:08d}{sharded_checkpoint.SUFFIX}",
                                  sharded_checkpoint.local_bytes(model, optimizer),
                                  next(c for c in causes if storage.is_storage_failure(c))) from None
        raise


def _failures(e: BaseException) -> List[BaseException]:
    """The ranks' own exceptions inside DCP's CheckpointException (each wrapped with its traceback)."""
    failures = getattr(e, "failures", None) or {}
    return [getattr(f, "exception", f) for f in failures.values() if isinstance(getattr(f, "exception", f),
                                                                                  BaseException)]


def publish_sharded_checkpoint(run_dir: Path, temp: Path, trainer_state: Dict[str, Any], keep: int) -> Path:
    """Rank 0 makes the shards every rank wrote a checkpoint (trainer/sharded_checkpoint.py ``publish``), then keeps
    the newest ``keep`` (checked by the plan: at least 1), as ``save_checkpoint`` does for a file."""
    needed = storage.nbytes(trainer_state) + storage.HEADROOM
    try:
        final = sharded_checkpoint.publish(temp, trainer_state)
    except Exception as e:
        if storage.is_storage_failure(e):
            raise storage.failure("checkpoint", temp, needed, e) from None
        raise
    _prune(checkpoint_dir(run_dir), run_dir, keep, written=final)
    return final


def save_best(run_dir: Path, state: Dict[str, Any]) -> Path:
    """Writes ``state`` as ``run_dir/checkpoints/best.pt`` atomically (retention leaves it alone)."""
    return _write_atomically(checkpoint_dir(run_dir) / BEST_NAME, state)


def _write_atomically(final: Path, state: Dict[str, Any]) -> Path:
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
        fd, temp_name = tempfile.mkstemp(prefix=f"{_TEMP_PREFIX}{final.stem}_", suffix=".pt", dir=folder)
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


def _prune(folder: Path, run_dir: Path, keep: int, written: Path) -> None:
    """Keeps the newest ``keep`` complete checkpoints and ``written``; removes damaged ones and temp files.

    Only complete files count toward ``keep``: a truncated newest file must not push out
    the good one a resume falls back to. Damaged files are removed, so that one newer than
    this run's last save (a run that resumed from an older checkpoint, past a truncated
    newer one, and ended before reaching its step) can never outrank this run's newest
    checkpoint on the next ``resume=auto``. ``written`` (just saved and fsynced) always
    stays, even when newer complete files of an earlier run fill ``keep``.
    """
    complete = []
    for path in reversed(list_checkpoints(run_dir)):  # newest first
        if path == written:
            complete.append(path)
            continue
        try:
            damage = _damage(path)
        except OSError as e:  # cannot even read it (permissions, I/O): neither counted nor removed
            log.warning("cannot inspect checkpoint %s (%s); leaving it in place", path, _short_cause(e))
            continue
        if damage is None:
            complete.append(path)
        else:
            log.warning("removing unreadable checkpoint %s (%s)", path, damage)
            _remove(path)
    for old in complete[keep:]:
        if old != written:
            _remove(old)
    # Temp files (and sharded checkpoints' temp directories) left by a save that was killed mid-write:
    # pruning follows a finished save, so none is live.
    for stale in folder.glob(f"{_TEMP_PREFIX}*"):
        _remove(stale)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _damage(path: Path) -> Optional[str]:
    """Why ``path`` is not a complete checkpoint, judged from its zip central directory; None if it looks whole.

    Retention runs on every save, so it does not ``torch.load`` (seconds per GB) each kept
    file. ``torch.save`` writes a zip archive whose central directory is the last thing in
    the file: a truncated (or zero-filled, or foreign) file has none, which ``zipfile`` finds
    by reading the file's tail. A file that passes but fails to load (damage inside the data)
    still counts here; ``latest_checkpoint`` skips it, and the just-written file always stays.
    Raises OSError when the file cannot be read at all.
    """
    if sharded_checkpoint.is_sharded_checkpoint(path):
        return sharded_checkpoint.damage(path)
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except OSError:
        raise
    except Exception as e:  # zipfile.BadZipFile mostly; a garbled directory can raise others
        return f"not a complete zip archive: {_short_cause(e)}"
    if not any(name == "data.pkl" or name.endswith("/data.pkl") for name in names):
        return "a zip archive without torch's data.pkl"
    return None


class UnreadableCheckpoint(Exception):
    """``path`` is not a loadable checkpoint; ``cause`` says why in one line (never torch's advice)."""

    def __init__(self, path: Path, cause: str):
        super().__init__(f"{path}: {cause}")
        self.path, self.cause = path, cause


def _short_cause(e: BaseException) -> str:
    """``Type: first sentence`` of an exception from ``torch.load``/``zipfile``, at most one line.

    torch's messages go on with advice to retry with ``weights_only=False``, which would run
    whatever code the (damaged or foreign) file pickled; that advice is dropped here.
    """
    text = e.strerror if isinstance(e, OSError) and e.strerror else str(e)  # strerror: the path is named elsewhere
    marker = "WeightsUnpickler error:"  # torch: "Weights only load failed. <advice> ... WeightsUnpickler error: <why>"
    if marker in text:
        text = text.split(marker, 1)[1]
    first = re.split(r"(?<=[.!?])\s+(?=[A-Z(])|\n", text.strip(), maxsplit=1)[0].strip().rstrip(".")
    if not first or "weights_only" in first:
        return type(e).__name__
    return f"{type(e).__name__}: {first[:200]}"


def load_checkpoint(path: Path) -> Dict[str, Any]:
    """Loads one checkpoint onto the CPU with ``weights_only=True`` (a sharded one: its training state, its
    model and optimizer read later, into the live ones); raises UnreadableCheckpoint on a bad one."""
    try:
        if sharded_checkpoint.is_sharded_checkpoint(path):
            state = sharded_checkpoint.read(path)
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch.load raises many types for a damaged file
        raise UnreadableCheckpoint(path, _short_cause(e)) from e
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


def check_compatible(state: Dict[str, Any], recipe_name: str, *, resume: str = "auto",
                     path: Optional[Path] = None) -> None:
    """Raises ConfigError when ``state`` was not written by a run of ``recipe_name``."""
    saved = state.get("recipe")
    where = f" ({path})" if path is not None else ""
    if saved is None:
        raise ConfigError(f"checkpoint.resume={resume} found a checkpoint{where} with no recipe name: "
                          "set checkpoint.resume=never, or run_dir=... to a fresh directory")
    if saved != recipe_name:
        raise ConfigError(f"checkpoint.resume={resume} holds a checkpoint{where} of recipe {saved!r} "
                          f"but recipe={recipe_name}: set checkpoint.resume=never or use recipe={saved}")


def check_same_epochs(state: Dict[str, Any], config: Dict[str, Any], steps_per_epoch: int, *, resume: str = "auto",
                      path: Optional[Path] = None) -> None:
    """Raises ConfigError when ``state`` counts its steps over epochs of another length because
    ``recipe.data.drop_last`` differs: its step would resume at another sample of the epoch.
    A checkpoint from before the setting existed was written with the last partial batch dropped."""
    saved = (state.get("config") or {}).get("recipe", {}).get("data", {})
    saved_drop = bool(saved.get("drop_last", True))
    drop = (config.get("recipe") or {}).get("data", {}).get("drop_last")
    if drop is None:  # a state without this run's config (a test, a tool): nothing to compare
        return
    saved_steps = state.get("steps_per_epoch")
    if saved_drop == drop or saved_steps == steps_per_epoch:
        return
    if saved_steps is None and drop:  # an old checkpoint (dropped) resumed dropping: the same epochs
        return
    where = f" ({path})" if path is not None else ""
    had = f" ({saved_steps} steps per epoch)" if saved_steps is not None else ""
    raise ConfigError(
        f"checkpoint.resume={resume} found a checkpoint{where} written with recipe.data.drop_last="
        f"{str(saved_drop).lower()}{had}, but this run has drop_last={str(drop).lower()} ({steps_per_epoch} steps per "
        f"epoch): its step {state.get('step')} would resume at another sample of the epoch. Set recipe.data.drop_last="
        f"{str(saved_drop).lower()} to resume it, or checkpoint.resume=never to start over")


def load_model_state(model: torch.nn.Module, state: Dict[str, Any], config: Dict[str, Any], *,
                     resume: str = "auto", path: Optional[Path] = None) -> None:
    """``model.load_state_dict(state["model"])`` (into a sharded model's shards too); a checkpoint of another
    model is refused with the ``recipe.model`` settings that differ between its config and this run's named."""
    try:
        put_model_state(model, state["model"])
    except RuntimeError as e:
        saved = (state.get("config") or {}).get("recipe", {}).get("model") or {}
        now = (config.get("recipe") or {}).get("model") or {}
        differ = [f"recipe.model.{k}={_shown(saved, k)} there, {_shown(now, k)} here"
                  for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)]
        where = f" ({path})" if path is not None else ""
        cause = "; ".join(differ) if differ else str(e).strip().splitlines()[0][:300]
        raise ConfigError(f"checkpoint.resume={resume} found a checkpoint{where} of another model ({cause}): set the "
                          "same recipe.model settings to resume it, or checkpoint.resume=never to start over") from None


def put_model_state(model: torch.nn.Module, saved: Any) -> None:
    """A checkpoint's model into ``model``, in place: from a sharded checkpoint's shards (any world size, a
    plain model too), or whole tensors (into a sharded model's shards too)."""
    if isinstance(saved, sharded_checkpoint.ShardedState):
        sharded_checkpoint.load_model(model, saved)
    else:
        sharding.load_whole_model_state(model, saved)


def _shown(settings: Dict[str, Any], key: str) -> str:
    return "unset (the default)" if key not in settings else str(settings[key]).lower() if isinstance(
        settings[key], bool) else str(settings[key])


def load_optimizer_state(optimizer: torch.optim.Optimizer, saved: Dict[str, Any],
                         model: Optional[torch.nn.Module] = None) -> None:
    """``optimizer.load_state_dict(saved)`` that keeps the live tensor hyper-parameters.

    ``load_state_dict`` swaps each param group's entries for the saved objects, so a
    tensor ``lr`` would become a new CPU tensor: the schedule and any captured graph
    would then hold a stale address. Here the saved values are copied into the
    tensors the optimizer already had (on their device). Load before capturing. ``model``: the
    optimizer's model, needed when it is sharded (its shards take their part of each state).
    """
    live = [{k: v for k, v in g.items() if k != "params" and isinstance(v, torch.Tensor)}
            for g in optimizer.param_groups]
    if isinstance(saved, sharded_checkpoint.ShardedState):
        sharded_checkpoint.load_optimizer(model, optimizer, saved)
    elif model is None:
        optimizer.load_state_dict(saved)
    else:
        sharding.load_whole_optimizer_state(model, optimizer, saved)
    for group, tensors in zip(optimizer.param_groups, live):
        for key, tensor in tensors.items():
            with torch.no_grad():
                tensor.copy_(torch.as_tensor(group[key]))
            group[key] = tensor


def rng_state() -> Dict[str, Any]:
    """This process's RNG states (torch CPU, current CUDA device, python, numpy), weights_only-loadable."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached_gauss = np.random.get_state(legacy=True)
    state: Dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": {"version": version, "internal": list(internal), "gauss": gauss},
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gauss)},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()  # the current device: one GPU per process
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    """Restores what ``rng_state`` captured. A CUDA state is skipped on a machine without CUDA."""
    torch.set_rng_state(state["torch"].cpu())
    py = state["python"]
    random.setstate((py["version"], tuple(py["internal"]), py["gauss"]))
    npy = state["numpy"]
    np.random.set_state((npy["kind"], npy["keys"].numpy().astype(np.uint32), npy["pos"],
                         npy["has_gauss"], npy["cached_gaussian"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"].cpu())
