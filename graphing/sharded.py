"""Whether a model is sharded with FSDP2, and whether a tensor is one of its DTensors: asked here, once.

graphing takes whatever model its caller hands over (a plain module, a DDP model, one sharded with
FSDP2's ``fully_shard``, inside a wrapper such as a compiled model and loss), so it asks the model
itself: every executor, the doctor and gradient accumulation call ``sharded_units`` or ``is_sharded``
here, and ``RunningMeans`` and ``weights_digest`` call ``is_dtensor``. A new kind of sharded model
(tensor parallel, float8 all-gathers) is taught here.
"""
from __future__ import annotations

from typing import List

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
