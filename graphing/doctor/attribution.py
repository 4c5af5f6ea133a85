"""Which line a torch call is blamed on: the innermost frame outside torch, the standard library,
installed packages and the doctor, i.e. a line of the user's code, of a recipe, or of trainer/.

Calls made inside torch's own DDP, optimizers, data loading or compile machinery are left out:
they are checked as a whole (DDP's settings, the optimizer's capturability), and DDP's early host
syncs stop after its warm-up.
"""
from __future__ import annotations

import functools
import inspect
import os
import site
import sysconfig
from typing import Any, Optional, Tuple

import torch

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


def _library_dirs() -> Tuple[str, ...]:
    paths = set()
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        p = sysconfig.get_paths().get(key)
        if p:
            paths.add(os.path.abspath(p) + os.sep)
    try:
        paths.update(os.path.abspath(p) + os.sep for p in site.getsitepackages())
    except AttributeError:  # some virtualenvs
        pass
    paths.add(_TORCH_DIR)
    return tuple(sorted(paths))


_LIBRARY_DIRS = _library_dirs()
_DOCTOR_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
# graphing/capture.py runs each checked step on the side stream (run_on_stream) and the capture
# attempt: its frames stand between the doctor and the step, as the doctor's own do.
_CAPTURE_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "capture.py")

# torch's own machinery whose calls are checked as a whole, not call by call: DDP (its host syncs
# stop after its warm-up), optimizers (capturability is checked on the object), data loading,
# compile, CUDA utilities. Matched against paths relative to torch's package directory.
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
    if path.startswith(_LIBRARY_DIRS) or f"{os.sep}site-packages{os.sep}" in path \
            or f"{os.sep}dist-packages{os.sep}" in path:
        return "library", None
    return "user", None


def is_user_file(filename: str) -> bool:
    return classify_file(filename)[0] == "user"


def user_site(frame) -> Tuple[Optional[Any], Optional[str]]:
    """(innermost user frame at or above ``frame``, tag of the innermost tagged library frame below it)."""
    tag = None
    while frame is not None:
        kind, frame_tag = classify_file(frame.f_code.co_filename)
        if kind == "user":
            return frame, tag
        if tag is None and frame_tag is not None:
            tag = frame_tag
        frame = frame.f_back
    return None, tag
