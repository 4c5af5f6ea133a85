"""What graphing knows of sharded models and their DTensors, asked here, once.

graphing takes whatever model its caller hands over (a plain module, a DDP model, one sharded with
FSDP2's ``fully_shard``, inside a wrapper such as a compiled model and loss), so it asks the model
itself: every executor, the doctor and gradient accumulation call ``sharded_units`` or ``is_sharded``.
Every DTensor question is answered here too, and nowhere else in graphing: whether a tensor is one
(``is_dtensor``), its whole value (``whole_value``: ``RunningMeans``), this rank's part and where it
lies in the whole (``local_tensor``, ``local_part``: ``weights_digest``, the float8 scale watch). A new
kind of sharded model (tensor parallel) is taught here. FSDP2's float8 all-gather itself is torchao's
(the trainer's trainer/parallel/float8_cast.py); graphing only watches the scales a step sets
(graphing/float8_scales.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

import torch


def sharded_units(model: torch.nn.Module) -> List[torch.nn.Module]:
    """The modules of ``model`` sharded with FSDP2's ``fully_shard`` (itself, or inside a wrapper such as a
    compiled model and loss), outermost first (the first is the root); none where torch has no FSDP2."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return []
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether ``model`` holds a module sharded with FSDP2 (``sharded_units``): FSDP2 then communicates itself,
    and no DDP goes around it."""
    return bool(sharded_units(model))


def is_dtensor(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a DTensor (FSDP2's parameters, their gradients, a norm over them). Duck-typed: no
    import of torch.distributed.tensor for models that never shard."""
    return hasattr(tensor, "to_local")


def whole_value(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value on every rank (a collective: every rank calls it; a replicated one, such as
    FSDP2's ``clip_grad_norm_`` result, is only read); any other tensor as it is."""
    return tensor.full_tensor() if is_dtensor(tensor) else tensor


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's own tensor for this rank (the very object: an attribute set on it, such as torchao's float8
    scale, is there; ``to_local`` returns a new view of a parameter's since torch 2.14, and one that autograd
    tracks), for reading and for in-place writes outside autograd; any other tensor as it is."""
    return tensor._local_tensor if is_dtensor(tensor) else tensor


@dataclass(frozen=True)
class LocalPart:
    """This rank's part of a tensor: its ``values`` (a DTensor's local shard; a plain tensor whole), the global
    index of their first element in each dimension (``offset``), whether this rank is the one that counts them
    (``counts``: the first of every mesh dimension they are replicated over), whether the tensor is a DTensor
    (``sharded``), and how it is laid out (``layout``: its placements; "" for a plain tensor)."""
    values: torch.Tensor
    offset: Tuple[int, ...]
    counts: bool
    sharded: bool
    layout: str


def local_part(tensor: torch.Tensor) -> LocalPart:
    """``tensor``'s ``LocalPart`` on this rank. A DTensor's offset comes from DTensor's own layout helper
    (private, present in torch 2.11 to 2.15); where it is missing, dim-0 sharding on a 1-D mesh is laid out as
    ``torch.chunk`` lays it, as DTensor does."""
    if not is_dtensor(tensor):
        return LocalPart(tensor, (0,) * tensor.dim(), True, False, "")
    mesh, placements = tensor.device_mesh, tensor.placements
    coordinate = mesh.get_coordinate() or [0] * mesh.ndim
    counts = all(c == 0 for c, placement in zip(coordinate, placements) if placement.is_replicate())
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    except ImportError:
        if mesh.ndim != 1 or not placements[0].is_shard(0):
            raise
        rows, ranks = tensor.shape[0], mesh.size()
        chunk = -(-rows // ranks)
        offset = (min(coordinate[0] * chunk, rows), *[0] * (tensor.dim() - 1))
    else:
        offset = tuple(compute_local_shape_and_global_offset(tensor.shape, mesh, placements)[1])
    return LocalPart(local_tensor(tensor), tuple(offset), counts, True, str(placements))
