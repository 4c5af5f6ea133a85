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


def dtensor_local_offset(tensor) -> tuple:
    """(the global offset of a DTensor's local shard, whether this rank is the first of every mesh dimension
    the tensor is replicated over). The offset comes from DTensor's own layout helper (private, present in
    torch 2.11 to 2.15); where it is missing, dim-0 sharding on a 1-D mesh is laid out as ``torch.chunk``
    lays it, as DTensor does."""
    mesh, placements = tensor.device_mesh, tensor.placements
    coordinate = mesh.get_coordinate() or [0] * mesh.ndim
    first = all(c == 0 for c, placement in zip(coordinate, placements) if placement.is_replicate())
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    except ImportError:
        if mesh.ndim != 1 or not placements[0].is_shard(0):
            raise
        rows, ranks = tensor.shape[0], mesh.size()
        chunk = -(-rows // ranks)
        return (min(coordinate[0] * chunk, rows), *[0] * (tensor.dim() - 1)), first
    _, offset = compute_local_shape_and_global_offset(tensor.shape, mesh, placements)
    return tuple(offset), first
