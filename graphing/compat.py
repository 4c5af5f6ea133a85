"""Differences between the torch versions this project supports, answered in one place."""
from __future__ import annotations

import functools
import inspect

import torch


@functools.lru_cache(maxsize=None)
def make_graphed_callables_takes_capture_error_mode() -> bool:
    """torch 2.15 passes ``capture_error_mode`` through ``make_graphed_callables``; 2.11 has no such argument."""
    return "capture_error_mode" in inspect.signature(torch.cuda.make_graphed_callables).parameters


@functools.lru_cache(maxsize=None)
def ddp_buffer_sync_argument() -> str:
    """The name DDP's constructor takes for its per-forward buffer broadcast: torch 2.14 renamed
    ``broadcast_buffers`` (2.11) to ``forward_sync_buffers``, and warns on the old name."""
    from torch.nn.parallel import DistributedDataParallel

    accepted = inspect.signature(DistributedDataParallel.__init__).parameters
    return "forward_sync_buffers" if "forward_sync_buffers" in accepted else "broadcast_buffers"


def __getattr__(name: str):
    # A DTensor's layout is graphing/sharded.py's to answer (the one place graphing handles DTensors)
    if name == "dtensor_local_offset":
        from graphing.deprecation import warn_renamed_once

        warn_renamed_once("graphing.compat.dtensor_local_offset", "graphing.sharded.local_part")
        return _dtensor_local_offset
    raise AttributeError(f"module 'graphing.compat' has no attribute {name!r}")


def _dtensor_local_offset(tensor) -> tuple:
    """(the global offset of a DTensor's local shard, whether this rank counts its values): the old form of
    ``graphing.sharded.local_part``."""
    from graphing.sharded import local_part

    part = local_part(tensor)
    return part.offset, part.counts
