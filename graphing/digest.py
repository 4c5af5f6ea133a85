"""One digest of a model's weights that does not depend on how they are split, computed where they live.

``weights_digest(model)`` hashes each element's exact bits together with its parameter's position
and its global index, and adds the hashes modulo 2**64. A sum does not care about order, so the
digest is the same whether a parameter is whole on one rank (DDP: every rank digests its own
replica, and equal digests prove the replicas equal) or sharded over several (FSDP2: each rank adds
its own shards' hashes, keyed by their global indices, and one all-reduce sums the ranks). The same
weights give the same digest under DDP and FSDP2, at any world size, without gathering a parameter
whole or copying one to the host: the work is elementwise on the device, a chunk at a time.

Floating-point values are hashed as float32 bits (bf16 and fp16 widen exactly; fp64 keeps its own
64 bits), integers as int64. The digest is a fingerprint for "bitwise the same weights", not a
cryptographic hash.
"""
from __future__ import annotations

import math
from typing import Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist

from graphing.sharded import local_part

CHUNK = 1 << 24  # elements hashed at a time: a few 64-bit temporaries of this size, whatever the model's size
_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as a signed int64 (torch has no uint64 arithmetic)
_MIX1 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_MIX2 = -7723592293110705685  # 0x94D049BB133111EB


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """A logical right shift of int64 values (torch's ``>>`` on int64 is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer, in place on int64 (products wrap modulo 2**64, as the hash wants)."""
    x ^= _shift_right(x, 30)
    x *= _MIX1
    x ^= _shift_right(x, 27)
    x *= _MIX2
    x ^= _shift_right(x, 31)
    return x


def _bits(values: torch.Tensor) -> torch.Tensor:
    """Each element's exact bits as int64."""
    if values.dtype == torch.float64:
        return values.view(torch.int64)
    if values.is_floating_point():
        return values.float().view(torch.int32).to(torch.int64)
    return values.to(torch.int64)


def tensor_hash_sum(values: torch.Tensor, key: int, first_index: int = 0) -> torch.Tensor:
    """The sum (int64, modulo 2**64) of every element's hash of (``key``, its global flat index, its bits).

    ``values`` is contiguous data laid out row-major; its element ``j`` has the global flat index
    ``first_index + j`` (a shard of whole rows of a larger tensor starts at its first row's index).
    """
    flat = values.detach().reshape(-1)
    total = torch.zeros((), dtype=torch.int64, device=flat.device)
    seed = _mix(torch.tensor(key, dtype=torch.int64) * _GOLDEN + 1).item()  # per parameter, on the host: one scalar
    for start in range(0, flat.numel(), CHUNK):
        part = flat[start:start + CHUNK]
        index = torch.arange(first_index + start, first_index + start + part.numel(), dtype=torch.int64,
                             device=flat.device)
        h = _mix(index * _GOLDEN + seed)
        h ^= _bits(part)
        total += _mix(h).sum()
    return total


def _local_part(p: torch.Tensor) -> Tuple[torch.Tensor, int, bool, bool]:
    """(this rank's values of ``p``, the global flat index of their first element, whether this rank counts
    them, whether ``p`` is sharded): a plain tensor whole; a DTensor's local shard at its global offset
    (graphing/sharded.py ``local_part``). A replicated mesh dimension counts its values on its first coordinate
    only, so that one all-reduce sums each element once."""
    part = local_part(p)
    local, offset = part.values, part.offset
    whole_rows = all(o == 0 for o in offset[1:]) and tuple(local.shape[1:]) == tuple(p.shape[1:])
    if local.numel() and not whole_rows:
        raise NotImplementedError(
            f"weights_digest: a DTensor parameter of shape {tuple(p.shape)} whose local shard {tuple(local.shape)} at "
            f"{offset} is not a block of whole rows (placements {part.layout}); shard it on dim 0 as FSDP2 does")
    first = offset[0] * math.prod(p.shape[1:]) if p.dim() else 0
    return local.contiguous(), first, part.counts, part.sharded


def weights_digest(model: torch.nn.Module, parameters: Optional[Iterable[torch.Tensor]] = None) -> str:
    """A 16-hex-digit digest of ``model``'s parameters (or of ``parameters``), equal for bitwise-equal
    weights however they are sharded (module docstring).

    With DTensor (FSDP2) parameters it is a collective: every rank calls it, one all-reduce of one
    number, and every rank returns the same digest. With plain parameters it is local: each DDP
    rank digests its own replica (compare them across ranks to prove the replicas equal).
    """
    params: List[torch.Tensor] = list(model.parameters() if parameters is None else parameters)
    if not params:
        return f"{0:016x}"
    parts = [_local_part(p) for p in params]
    total = torch.zeros((), dtype=torch.int64, device=parts[0][0].device)
    with torch.no_grad():
        for key, (local, first, counts, _) in enumerate(parts):
            if counts and local.numel():
                total += tensor_hash_sum(local, key, first).to(total.device)
    sharded = any(part[3] for part in parts)
    if sharded and dist.is_available() and dist.is_initialized():
        dist.all_reduce(total)  # int64 sums wrap modulo 2**64 on every backend, as the hash wants
    return f"{total.item() & (2**64 - 1):016x}"
