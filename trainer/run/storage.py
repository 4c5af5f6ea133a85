"""Writes that can fail for lack of room (no space, quota, read-only, permission), said once and plainly.

A failed write becomes ``StorageError`` (trainer/run/errors.py): a message that names the path,
the bytes the write needed and the bytes free there, and what to do. ``torch.save`` can fail
without an errno (``RuntimeError: [enforce fail at inline_container.cc:...] ... file write
failed``), so the room is measured here, before a write (``check_room``), and again when one
fails (``failure``), rather than read from the exception.

The policy (stated in docs/checkpoints.md): rank 0 writes; the outcome travels
to every rank in the collective that ends the write (trainer/checkpoint/state.py), so no rank waits for a
write that failed nor trains on alone. A failed checkpoint stops the run with exit 5 and the
last good checkpoint named: a full disk rarely frees itself, and training on without a
checkpoint puts more work at risk with every step. Metrics rows that cannot be appended are
kept in memory and written before the next checkpoint; if they still cannot be written, that
checkpoint's decision is the same stop.
"""
from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Any, Optional

from trainer.run.errors import StorageError
from trainer.run.stop import writing

# Errors that mean "this storage cannot take the write", as opposed to a bug in what is written.
_STORAGE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO, errno.EFBIG,
                   errno.ENOTDIR, errno.EISDIR}
# torch.save's C++ writer fails with a RuntimeError that carries no errno.
_TORCH_WRITE_FAILED = ("inline_container", "file write failed", "PytorchStreamWriter")
HEADROOM = 64 * 1024  # zip directory, pickle and filesystem blocks beyond the tensors' bytes


def fsync(path: Path) -> None:
    """Flushes ``path`` (a file, or a directory: so that a rename in it survives a power loss) to disk;
    a platform that cannot open directories is left as it is."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def free_bytes(path: Path) -> Optional[int]:
    """Bytes free to this user on the filesystem of ``path`` (its nearest existing parent), or None."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def nbytes(obj: Any) -> int:
    """The tensors' bytes in a (nested) checkpoint state: what ``torch.save`` will write, give or take headers."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.untyped_storage().nbytes() if obj.device.type != "meta" else 0
    if isinstance(obj, dict):
        return sum(nbytes(v) for v in obj.values()) + 64 * len(obj)
    if isinstance(obj, (list, tuple)):
        return sum(nbytes(v) for v in obj) + 8 * len(obj)
    if isinstance(obj, (str, bytes)):
        return len(obj)
    return 16


def is_storage_failure(e: BaseException) -> bool:
    if isinstance(e, OSError):
        return e.errno in _STORAGE_ERRNOS
    return isinstance(e, RuntimeError) and any(mark in str(e) for mark in _TORCH_WRITE_FAILED)


def _size(n: Optional[int]) -> str:
    if n is None:
        return "unknown"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit} ({n} bytes)"
    return f"{n} bytes"


def _message(what: str, path: Path, needed: int, free: Optional[int], cause: str) -> str:
    return (f"cannot write {what} {path}: {cause}; it needs about {_size(needed)}, "
            f"{_size(free)} free there")


def check_room(what: str, path: Path, needed: int) -> None:
    """Raises StorageError when the filesystem of ``path`` has less than ``needed`` bytes free: nothing is written."""
    free = free_bytes(path.parent)
    if free is not None and free < needed:
        raise StorageError(_message(what, path, needed, free, "not enough free space"), path=path, needed=needed,
                           free=free)


def failure(what: str, path: Path, needed: int, e: BaseException) -> StorageError:
    """The StorageError for a write of ``path`` that raised ``e`` (an OSError or torch's errno-less RuntimeError)."""
    if isinstance(e, OSError) and e.errno is not None:
        cause = f"{errno.errorcode.get(e.errno, e.errno)} ({os.strerror(e.errno)})"
    else:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        cause = f"{type(e).__name__}: {first[:200]}"
    free = free_bytes(path.parent)
    return StorageError(_message(what, path, needed, free, cause), path=path, needed=needed, free=free)


def write_text_atomically(what: str, path: Path, text: str) -> None:
    """``path`` gets ``text`` whole or not at all (temp file, fsync, rename); StorageError names a failure."""
    data = text.encode()
    needed = len(data) + 4096
    check_room(what, path, needed)
    temp = path.with_name(f".tmp_{path.name}.{os.getpid()}")
    try:
        with writing(temp), open(temp, "wb") as f:  # a Ctrl-C meanwhile removes it
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
            os.replace(temp, path)
    except OSError as e:
        try:
            temp.unlink(missing_ok=True)
        except OSError:
            pass
        if is_storage_failure(e):
            raise failure(what, path, needed, e) from None
        raise
