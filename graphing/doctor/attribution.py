"""Which line a torch call is blamed on: the innermost frame outside torch, the standard library,
installed packages and the doctor, i.e. a line of the user's code, of a recipe, or of trainer/;
and, when the call was made inside an installed package (a model library such as transformers),
that package's innermost line too: the user's line says where to look, the package's what ran.

Calls made by torch's own DDP and FSDP2, optimizers, data loading or compile machinery are left
out: they are checked as a whole (DDP's settings, the optimizer's capturability), and DDP's early
host syncs stop after its warm-up. Only torch's own frames below the first frame of other code
count for that: a model's forward that DDP calls, or that runs between FSDP2's hooks (the
user's, or a library's), is judged as it is in one process, so one rank and N ranks get the same
findings.
"""
from __future__ import annotations

import functools
import inspect
import os
import site
import sys
import sysconfig
from typing import Any, NamedTuple, Optional, Tuple

import torch

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


def _dirs(paths) -> Tuple[str, ...]:
    return tuple(sorted({os.path.abspath(p) + os.sep for p in paths if p}))


def _package_dirs() -> Tuple[str, ...]:
    paths = [sysconfig.get_paths().get(key) for key in ("purelib", "platlib")]
    try:
        paths += site.getsitepackages()
    except AttributeError:  # some virtualenvs
        pass
    return _dirs(paths)


# Installed packages, then the standard library: a virtualenv's platstdlib holds its site-packages.
_PACKAGE_DIRS = _package_dirs()
_STDLIB_DIRS = _dirs(sysconfig.get_paths().get(key) for key in ("stdlib", "platstdlib"))
_DOCTOR_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
# graphing/capture.py runs each checked step on the side stream (run_on_stream) and the capture
# attempt: its frames stand between the doctor and the step, as the doctor's own do.
_CAPTURE_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "capture.py")

# torch's own machinery whose calls are checked as a whole, not call by call: DDP (its host syncs
# stop after its warm-up), FSDP2 (its hooks' all-gathers and copies, its reduce-scatters: both under
# distributed/), optimizers (capturability is checked on the object), data loading, compile, CUDA
# utilities. Matched against paths relative to torch's package directory.
_IGNORED_TORCH = ("nn/parallel/", "distributed/", "optim/", "_dynamo/", "_inductor/", "utils/data/", "profiler/",
                  "autograd/profiler", "_functorch/", "cuda/__init__", "cuda/graphs", "cuda/memory", "cuda/streams")
_SCALER_TORCH = ("amp/grad_scaler", "cuda/amp/grad_scaler")
_QUIET_TORCH = ("amp/", "cuda/amp/")  # autocast and scaler bookkeeping: not compared between steps


@functools.lru_cache(maxsize=None)
def syncbn_syncs_while_capturing() -> bool:
    """True when this torch's SyncBatchNorm makes its host sync during a CUDA graph capture too.

    Recent torch (2.11 included) skips the sync (a boolean mask over gathered counts) while the
    stream is capturing; its eager steps still make it, which is then no finding.
    """
    try:
        from torch.nn.modules import _functions
        return "is_current_stream_capturing" not in inspect.getsource(_functions.SyncBatchNorm.forward)
    except (ImportError, AttributeError, OSError, TypeError):
        return True


def _in_package_dir(path: str) -> bool:
    return path.startswith(_PACKAGE_DIRS) or f"{os.sep}site-packages{os.sep}" in path \
        or f"{os.sep}dist-packages{os.sep}" in path


@functools.lru_cache(maxsize=None)
def classify_file(filename: str) -> Tuple[str, Optional[str]]:
    """("user" | "doctor" | "library", tag) where tag is "ignore", "scaler", "quiet" or None."""
    if filename.startswith("<frozen"):
        return "library", None
    path = os.path.abspath(filename) if not filename.startswith("<") else filename
    if path.startswith(_DOCTOR_DIR) or path == _CAPTURE_FILE:
        return "doctor", None
    if path.startswith(_TORCH_DIR):
        rel = path[len(_TORCH_DIR):].replace(os.sep, "/")
        if rel.startswith(_SCALER_TORCH):
            return "library", "scaler"
        ignored = _IGNORED_TORCH + (() if syncbn_syncs_while_capturing() else ("nn/modules/_functions",))
        if rel.startswith(ignored):
            return "library", "ignore"
        if rel.startswith(_QUIET_TORCH):
            return "library", "quiet"
        return "library", None
    if _in_package_dir(path) or path.startswith(_STDLIB_DIRS):
        return "library", None
    return "user", None


@functools.lru_cache(maxsize=None)
def is_package_file(filename: str) -> bool:
    """A file of an installed package other than torch (a model library), not of the standard library."""
    if filename.startswith("<"):
        return False
    path = os.path.abspath(filename)
    return not path.startswith(_TORCH_DIR) and _in_package_dir(path)


def is_user_file(filename: str) -> bool:
    return classify_file(filename)[0] == "user"


class Site(NamedTuple):
    """Where a call came from: the user's frame, the innermost frame of an installed package below
    it (None when the user's code called torch directly), and the tag of torch's machinery that
    made the call itself (None when other code did)."""

    user: Optional[Any]
    library: Optional[Any]
    tag: Optional[str]


def call_site(frame) -> Site:
    """The ``Site`` of a call whose innermost Python frame is ``frame``.

    The tag comes only from torch's frames below the first frame of other code: DDP's frames above
    a model's forward (a library's or the user's) do not hide what that forward does.
    """
    tag, library, tagging = None, None, True
    while frame is not None:
        filename = frame.f_code.co_filename
        kind, frame_tag = classify_file(filename)
        if kind == "user":
            return Site(frame, library, tag)
        if library is None and is_package_file(filename):
            library, tagging = frame, False
        if tagging and tag is None and frame_tag is not None:
            tag = frame_tag
        frame = frame.f_back
    return Site(None, library, tag)


def user_site(frame) -> Tuple[Optional[Any], Optional[str]]:
    """(innermost user frame at or above ``frame``, the tag of torch's machinery that made the call)."""
    site_ = call_site(frame)
    return site_.user, site_.tag


def short_path(path: str) -> str:
    """A package file as its import path shows it (``transformers/masking_utils.py``), else the path."""
    for marker in (f"{os.sep}site-packages{os.sep}", f"{os.sep}dist-packages{os.sep}"):
        if marker in path:
            return path.rsplit(marker, 1)[1]
    roots = [root for root in (*_PACKAGE_DIRS, *(os.path.abspath(p or ".") + os.sep for p in sys.path))
             if path.startswith(root)]
    return path[len(max(roots, key=len)):] if roots else path
